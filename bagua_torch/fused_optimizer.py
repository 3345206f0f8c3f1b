"""A generic fused optimizer: any elementwise torch optimizer steps over a few flat tensors.

``fuse_optimizer(optimizer)`` lays the parameters of each (param group, dtype, device) out in
one contiguous buffer, makes every parameter a view of it, and steps a fresh optimizer of the
same class over the flat buffers: one call per chunk instead of one per tensor, which is what
torch's own ``foreach``/``fused`` kernels do for a handful of built-in optimizers, here for any
elementwise one (a user's plain-Python optimizer included).

Correctness comes first:

- the wrapper never patches the optimizer's class; the original optimizer is left untouched;
- frozen parameters (``requires_grad=False``) stay out of the buffers;
- a parameter without a gradient this step (unused in the forward pass) makes its chunk step
  parameter by parameter that step, exactly as the unfused optimizer skips it (one warning);
- optimizers known not to be elementwise (``NOT_ELEMENTWISE``, LAMB, LARS) are refused unless
  ``elementwise=True``; on the first step a sample of parameters is also stepped by the original
  class, tensor by tensor: a mismatch restores everything and raises.

``state_dict()`` is the unfused optimizer's, so checkpoints move both ways between the two. Unlike
Bagua's, the default ``zero_grad()`` (``set_to_none=True``) keeps fusion on: fresh gradients are
copied into the flat buffer (counted in :meth:`FusedOptimizer.stats`); with
``zero_grad(set_to_none=False)`` backward accumulates straight into it.

With a wrapped model (``fuse_optimizer(optimizer, module=model)``) the chunks are runs of the
model's buckets (:mod:`bagua_torch.flat_layout`): backward accumulates into the buckets and the
reduced bucket is the optimizer's gradient, uncopied with ``zero_grad(set_to_none=False)`` and an
algorithm that hands its result over (``stats()`` counts the copies). An optimizer given to a
wrapped model is replaced there by the fused one (``BaguaModule.replace_optimizer``), so the
algorithm's step hooks go on. QAdam's and 1-bit Adam's optimizers are refused: after the warm-up
their step is not elementwise.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from bagua_torch.bagua_module import BaguaModule, wrapper_of
from bagua_torch.flat_layout import Chunk, check_state_shapes, lay_out, member_value, same_value, slice_ptr

if TYPE_CHECKING:
    from bagua_torch.reducer import Reducer

NOT_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon", "QAdamOptimizer", "OneBitAdamOptimizer")
"""Optimizer classes whose step is not elementwise (checked by name). QAdam's and 1-bit Adam's floor
their frozen second moment by its mean over each parameter tensor after the warm-up."""
NOT_ELEMENTWISE_MARKERS = ("lamb", "lars")
"""Class-name fragments of layer-wise optimizers (trust ratios per tensor)."""
VERIFY_SAMPLE = 64
"""How many parameters the first step re-checks against the unfused optimizer."""


class FusedOptimizer(torch.optim.Optimizer):
    """The wrapper :func:`fuse_optimizer` returns: a drop-in for the optimizer it wraps.

    ``param_groups`` are the original optimizer's groups (same parameters, same
    hyper-parameters), so learning-rate schedulers and ``torch.amp.GradScaler`` work on it as
    on the original; ``inner`` is the optimizer of the same class that steps the flat buffers.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        module: BaguaModule | None = None,
        elementwise: bool | None = None,
    ):
        cls = type(optimizer)
        if isinstance(optimizer, FusedOptimizer):
            raise TypeError("fuse_optimizer: this optimizer is already fused")
        self._module = module
        self._reducer: Reducer | None = None
        if module is not None:
            reducer = getattr(module, "reducer", None)
            if reducer is None:
                raise TypeError(
                    f"fuse_optimizer: module must be a wrapped model (a BaguaModule), got {type(module).__name__}"
                )
            reducer.bind_gradients_to_buckets()
            self._reducer = reducer
        if not elementwise:
            _refuse_known_non_elementwise(cls, elementwise)
        self._cls = cls
        # Rebuilt with its defaults and the constructor arguments it keeps as attributes outside them
        # (a warm-up length, say), which a rebuild from the defaults alone would silently reset.
        kept = inspect.signature(cls.__init__).parameters.keys() - optimizer.defaults.keys() - {"self", "params"}
        self._defaults = {**optimizer.defaults, **{k: v for k, v in vars(optimizer).items() if k in kept}}
        original_state = optimizer.state_dict()
        groups = [dict(group) for group in optimizer.param_groups]
        super().__init__(groups, optimizer.defaults)
        self._chunks = lay_out(self.param_groups, self._reducer)
        self.inner = self._construct(
            [
                {**_hyper_parameters(group), "params": [c.flat for c in self._chunks if c.group == g]}
                for g, group in enumerate(self.param_groups)
            ]
        )
        self._verified = False
        self._warned_unused = False
        self._stats = {"fused_steps": 0, "unfused_chunk_steps": 0, "gradient_copies": 0, "bytes_copied": 0}
        self._load_per_parameter_state(original_state)
        holder = wrapper_of(optimizer)
        if holder is not None:
            if module is not None and holder is not module:
                raise ValueError("fuse_optimizer: the optimizer was given to another wrapped model than module")
            holder.replace_optimizer(optimizer, self)

    # -- the torch.optim.Optimizer interface -------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step every chunk once; returns what ``closure`` returned (if given).

        Fresh gradients are moved into the flat buffers first; a chunk with a member that has
        no gradient steps parameter by parameter this time, as the unfused optimizer would.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._follow_buckets()
        for g, group in enumerate(self.param_groups):
            self.inner.param_groups[g].update(_hyper_parameters(group))
        whole, partial = [], []
        for chunk in self._chunks:
            (whole if self._gather_gradients(chunk) and chunk.fused else partial).append(chunk)
        check = None if self._verified else self._prepare_verification(whole)
        for chunk in partial:
            chunk.flat.grad = None  # the inner optimizer skips it this step
        self.inner.step()
        for chunk in partial:
            self._step_per_parameter(chunk)
            chunk.flat.grad = chunk.flat_grad
        if check is not None:
            check()
        self._stats["fused_steps"] += 1
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients: ``set_to_none=False`` keeps them as views of the flat buffers.

        With ``set_to_none=True`` (torch's default) the gradients become ``None`` and the
        fresh ones backward allocates are copied into the flat buffers by the next
        :meth:`step`; with ``set_to_none=False`` backward accumulates into the buffers in
        place. As in torch, a gradient that is ``None`` stays ``None`` either way.
        """
        self._follow_buckets()
        for chunk in self._chunks:
            if set_to_none:
                for p in chunk.params:
                    p.grad = None
                continue
            present = [(p, view) for p, view in zip(chunk.params, chunk.grad_views) if p.grad is not None]
            for p, view in present:
                if p.grad is not view:
                    p.grad = view
            if len(present) == len(chunk.params):
                chunk.flat_grad.zero_()
            elif present:  # torch leaves a missing gradient missing
                torch._foreach_zero_([view for _, view in present])

    def state_dict(self) -> dict[str, Any]:
        """The state in the unfused optimizer's per-parameter layout (loadable by either)."""
        index = {p: i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        state: dict[int, dict[str, Any]] = {index[p]: s for p, s in self._frozen_state.items()}
        for chunk in self._chunks:
            for i, p in enumerate(chunk.params):
                member = self._member_state(chunk, i)
                if member:
                    state[index[p]] = {k: v.clone() if torch.is_tensor(v) else v for k, v in member.items()}
        groups = [
            {**_hyper_parameters(group), "params": [index[p] for p in group["params"]]} for group in self.param_groups
        ]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a per-parameter state dict, as written by this wrapper or the plain optimizer."""
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(
                f"load_state_dict: the state has {len(state_dict['param_groups'])} param groups, "
                f"the optimizer {len(self.param_groups)}"
            )
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("load_state_dict: a param group's size differs from the optimizer's")
            group.update({k: v for k, v in saved.items() if k != "params"})
        self._load_per_parameter_state(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused once fused: the flat layout is fixed; add groups before fusing."""
        if getattr(self, "_chunks", None) is None:  # torch.optim.Optimizer.__init__ adds the groups
            return super().add_param_group(param_group)
        raise RuntimeError("FusedOptimizer: add param groups to the optimizer before fusing it")

    def stats(self) -> dict[str, int]:
        """Counters: fused steps, chunks stepped per parameter, gradients copied and their bytes.

        With a wrapped model, ``model_bytes_copied`` adds the gradient bytes the model copied
        into or out of its buckets (:meth:`bagua_torch.reducer.Reducer.stats`).
        """
        stats = dict(self._stats, chunks=len(self._chunks))
        if self._reducer is not None:
            stats["model_bytes_copied"] = self._reducer.stats()["bytes_copied"]
        return stats

    def _follow_buckets(self) -> None:
        """Wait for the model's gradients; point chunks at their buckets' current buffers (the model may swap them)."""
        if self._module is None or self._reducer is None:
            return
        self._module.wait_gradients()
        for chunk in self._chunks:
            bucket = chunk.bucket
            if bucket is None or chunk.flat_grad.data_ptr() == slice_ptr(bucket, chunk.first):
                continue
            chunk.flat_grad = bucket.grad.narrow(0, bucket.offsets[chunk.first], chunk.flat.numel())
            chunk.grad_views = self._reducer.grad_views(bucket)[chunk.first : chunk.first + len(chunk.params)]
            chunk.flat.grad = chunk.flat_grad

    # -- gradients -------------------------------------------------------------------------

    def _gather_gradients(self, chunk: Chunk) -> bool:
        """Make every member's gradient a view of the chunk's flat gradient; False if one is None."""
        stale = []
        complete = True
        for p, view in zip(chunk.params, chunk.grad_views):
            grad = p.grad
            if grad is view:
                continue
            if grad is None:
                complete = False
            elif grad.is_sparse:
                raise ValueError(
                    f"fuse_optimizer: a parameter of shape {tuple(p.shape)} has a sparse gradient; "
                    "sparse gradients cannot be fused (use the optimizer unfused)"
                )
            else:
                stale.append((p, view, grad))
        if stale:
            if len(stale) == len(chunk.params):
                # One concatenation into the buffer: torch's foreach copy costs a dispatch per
                # tensor on CPU, several times the copy of small tensors itself.
                torch.cat([g if g.dim() == 1 else g.reshape(-1) for _, _, g in stale], out=chunk.flat_grad)
                copied = chunk.flat_grad.numel()
            else:
                views = [view for _, view, _ in stale]
                torch._foreach_copy_(views, [grad for _, _, grad in stale])
                copied = sum(view.numel() for view in views)
            for p, view, _ in stale:
                p.grad = view
            self._stats["gradient_copies"] += len(stale)
            self._stats["bytes_copied"] += copied * chunk.flat_grad.element_size()
        if not complete and not self._warned_unused:
            warnings.warn(
                "fuse_optimizer: some parameters have no gradient this step; their chunk steps "
                "parameter by parameter (as the unfused optimizer would) until all have one",
                stacklevel=3,
            )
            self._warned_unused = True
        return complete

    # -- per-parameter steps (members without a gradient, or members that disagree) ---------

    def _member_state(self, chunk: Chunk, i: int) -> dict[str, Any]:
        """Member ``i``'s optimizer state as the unfused optimizer would hold it (views)."""
        if not chunk.fused:
            return chunk.member_state.get(chunk.params[i], {})
        flat_state = self.inner.state.get(chunk.flat, {})
        return {k: member_value(chunk, i, v) for k, v in flat_state.items()}

    def _split(self, chunk: Chunk) -> None:
        """Move a fused chunk's state to per-parameter entries (param-shaped ones stay views)."""
        flat_state = self.inner.state.pop(chunk.flat, {})
        chunk.member_state = {
            p: {k: member_value(chunk, i, v) for k, v in flat_state.items()}
            for i, p in enumerate(chunk.params)
            if flat_state
        }
        chunk.fused = False

    def _step_per_parameter(self, chunk: Chunk) -> None:
        """Step the members that have a gradient one tensor at a time, then re-fuse if possible."""
        if chunk.fused:
            self._split(chunk)
        stepping = [p for p in chunk.params if p.grad is not None]
        if stepping:
            optimizer = self._plain_optimizer(chunk.group, stepping)
            for p in stepping:
                if p in chunk.member_state:
                    optimizer.state[p] = chunk.member_state[p]
            optimizer.step()
            for p in stepping:
                chunk.member_state[p] = optimizer.state[p]
        self._stats["unfused_chunk_steps"] += 1
        self._try_fuse(chunk)

    def _try_fuse(self, chunk: Chunk) -> None:
        """Fuse the chunk's state again once every member holds the same kind and step of state."""
        states = [chunk.member_state.get(p, {}) for p in chunk.params]
        if any(states) and not all(states):
            return
        keys = set(states[0])
        if any(set(s) != keys for s in states):
            return
        # Only with some non-scalar parameter can a state value be told apart from a shared
        # scalar such as Adam's 0-d ``step``; chunks of 0-d parameters fuse only equal values.
        shaped_like_params = any(p.dim() > 0 for p in chunk.params)
        fused: dict[str, Any] = {}
        for key in keys:
            values = [s[key] for s in states]
            if shaped_like_params and all(
                torch.is_tensor(v) and v.shape == p.shape for v, p in zip(values, chunk.params)
            ):
                flat = torch.empty(chunk.flat.shape, dtype=values[0].dtype, device=chunk.flat.device)
                for i, v in enumerate(values):
                    chunk.view(flat, i).copy_(v)
                fused[key] = flat
            elif all(same_value(v, values[0]) for v in values):
                fused[key] = values[0].clone() if torch.is_tensor(values[0]) else values[0]
            else:
                return
        if fused:
            self.inner.state[chunk.flat] = fused
        chunk.member_state = {}
        chunk.fused = True

    def _plain_optimizer(self, group: int, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """An unfused optimizer of the original class over ``params`` with group ``group``'s settings."""
        return self._construct([{**_hyper_parameters(self.param_groups[group]), "params": params}])

    def _construct(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """A new optimizer of the original class over ``groups`` (each carries every setting), given the
        constructor arguments it declares (AdamW's ``defaults``, for one, hold a key it does not take)."""
        parameters = inspect.signature(self._cls.__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        kwargs = {k: v for k, v in self._defaults.items() if takes_any or k in parameters}
        try:
            return self._cls(groups, **kwargs)
        except TypeError as error:
            raise TypeError(
                f"fuse_optimizer: {self._cls.__name__} cannot be rebuilt as "
                f"{self._cls.__name__}(param_groups, **defaults): {error}"
            ) from None

    def _load_per_parameter_state(self, state_dict: dict[str, Any]) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        saved = {params[int(i)]: s for i, s in state_dict.get("state", {}).items()}
        # Frozen parameters are never stepped; whatever state they had is kept as it was.
        self._frozen_state = {p: s for p, s in saved.items() if not p.requires_grad}
        for chunk in self._chunks:
            self.inner.state.pop(chunk.flat, None)
            chunk.member_state = {}
            for p in chunk.params:
                if p in saved:
                    check_state_shapes(p, saved[p])
                    chunk.member_state[p] = {
                        k: v.to(p.device).clone() if torch.is_tensor(v) and v.dim() > 0 else v
                        for k, v in saved[p].items()
                    }
            chunk.fused = False
            self._try_fuse(chunk)

    # -- first-step verification ------------------------------------------------------------

    def _prepare_verification(self, chunks: list[Chunk]) -> Callable[[], None] | None:
        """Step a sample of parameters with the original class; returns the check to run after.

        Before the first fused step every flat parameter and all state is saved; if the fused
        step then disagrees with the per-tensor one on any sampled parameter, everything is
        restored and a ``ValueError`` names the optimizer.
        """
        self._verified = True
        sample = [(chunk, i) for chunk in chunks for i in range(len(chunk.params))]
        if not sample:
            return None
        stride = max(1, len(sample) // VERIFY_SAMPLE)
        sample = sample[::stride][:VERIFY_SAMPLE]
        saved_flat = [c.flat.detach().clone() for c in self._chunks]
        saved_state = self.state_dict()
        expected: list[tuple[Chunk, int, torch.Tensor, dict[str, Any]]] = []
        for chunk, i in sample:
            p = chunk.params[i]
            clone = p.detach().clone().requires_grad_(False)
            clone.grad = p.grad.detach().clone()
            optimizer = self._plain_optimizer(chunk.group, [clone])
            state = self._member_state(chunk, i)
            if state:
                optimizer.state[clone] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            optimizer.step()
            expected.append((chunk, i, clone, optimizer.state.get(clone, {})))

        def check() -> None:
            for chunk, i, clone, state in expected:
                fused_state = self._member_state(chunk, i)
                if torch.equal(chunk.params[i].detach(), clone) and all(
                    same_value(fused_state.get(k), v) for k, v in state.items()
                ):
                    continue
                for c, flat in zip(self._chunks, saved_flat):
                    c.flat.data.copy_(flat)
                self._load_per_parameter_state(saved_state)
                self._verified = False
                raise ValueError(
                    f"fuse_optimizer: {self._cls.__name__} gives different results over a flat "
                    "buffer than parameter by parameter, so its step is not elementwise; use it "
                    "unfused (the step was undone)"
                )

        return check


def fuse_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    module: BaguaModule | None = None,
    elementwise: bool | None = None,
) -> FusedOptimizer:
    """Wrap ``optimizer`` so that it steps over one flat buffer per (group, dtype, device).

    Returns a :class:`FusedOptimizer` to use instead of ``optimizer`` (whose class is not
    patched). With ``module`` (the wrapped model the optimizer trains) the flat buffers are the
    model's communication buckets, so the reduced gradients are stepped where they were reduced.
    ``elementwise=True`` asserts that a class this module refuses by name (LAMB, LARS, LBFGS,
    ...) is elementwise after all; the first step checks it either way.
    """
    return FusedOptimizer(optimizer, module=module, elementwise=elementwise)


fuse_step = fuse_optimizer
"""Bagua's name for :func:`fuse_optimizer`."""


def _refuse_known_non_elementwise(cls: type, elementwise: bool | None) -> None:
    name = cls.__name__
    if name in NOT_ELEMENTWISE or any(m in name.lower() for m in NOT_ELEMENTWISE_MARKERS):
        raise TypeError(
            f"fuse_optimizer: {name} does not step elementwise (its update of a tensor depends on "
            "the whole tensor), so fusing would change its math; pass elementwise=True only if "
            "you know it is"
        )


def _hyper_parameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}
