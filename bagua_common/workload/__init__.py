"""The project's yardstick workload, neither JAX nor torch: a GPT's specification and the text it learns.

:mod:`~bagua_common.workload.gpt_spec` names the sizes (``tiny``, ``mini``, ``small``, ``gpt2``), the parameters and
their NumPy initialization, which ``bagua_jax.models.gpt`` and ``bagua_torch.models.gpt`` both load;
:mod:`~bagua_common.workload.corpus` is the pinned byte-level corpus (torch 2.13.0's Python source) with its
deterministic per-rank batches and the held-out evaluation set.
"""

from bagua_common.workload.corpus import CORPUS_DIGEST, ByteEntropies, Corpus, byte_entropies, load_corpus
from bagua_common.workload.gpt_spec import GPT_CONFIGS, GPTConfig, check_gpt_params, gpt_config, init_gpt_params

__all__ = [
    "CORPUS_DIGEST",
    "GPT_CONFIGS",
    "ByteEntropies",
    "Corpus",
    "GPTConfig",
    "byte_entropies",
    "check_gpt_params",
    "gpt_config",
    "init_gpt_params",
    "load_corpus",
]
