"""Bagua's communication-primitives example, redone as a Bagua user would write it, on CPU tensors.

Every Bagua primitive is checked against ``torch.distributed`` (gloo) on the same data; any
mismatch raises. Written against Bagua's own API (``import bagua.torch_api as bagua``); to run
it with this project change that one line to ``import bagua_torch.torch_api as bagua`` and
start it with ``bagua-launch --nproc-per-node 2 communication_primitives.py``
(``tests/test_bagua_migration_torch.py`` does).
"""

import bagua.torch_api as bagua
import torch
import torch.distributed as dist


def check(name, expected, got):
    assert torch.equal(expected, got), f"{name}: expected {expected}, got {got}"
    print(f"rank {bagua.get_rank()}: {name} ok", flush=True)


def main():
    assert bagua.get_world_size() >= 2, "world size must be at least 2"
    bagua.init_process_group()
    rank, nranks = bagua.get_rank(), bagua.get_world_size()
    comm = bagua.communication._get_default_group().get_global_communicator()
    torch.manual_seed(rank)

    # send, recv
    if rank == 0:
        send_tensor = torch.arange(4, dtype=torch.float32) + 0.5
        dist.send(send_tensor, 1)
        bagua.send(send_tensor, 1, comm=comm)
    elif rank == 1:
        recv_tensor = torch.zeros(4)
        recv_tensor_bagua = torch.zeros(4)
        dist.recv(recv_tensor, 0)
        bagua.recv(recv_tensor_bagua, 0, comm=comm)
        check("send/recv", recv_tensor, recv_tensor_bagua)

    # broadcast
    tensor = torch.rand(4) if rank == 0 else torch.zeros(4)
    tensor_bagua = tensor.clone()
    dist.broadcast(tensor, 0)
    bagua.broadcast(tensor_bagua, 0, comm=comm)
    check("broadcast", tensor, tensor_bagua)

    # allreduce and allreduce_inplace, every reduction
    for op, torch_op in [
        (bagua.ReduceOp.SUM, dist.ReduceOp.SUM),
        (bagua.ReduceOp.MAX, dist.ReduceOp.MAX),
        (bagua.ReduceOp.MIN, dist.ReduceOp.MIN),
        (bagua.ReduceOp.PRODUCT, dist.ReduceOp.PRODUCT),
    ]:
        send_tensor = torch.rand(4)
        send_tensor_bagua = send_tensor.clone()
        recv_tensor_bagua = torch.zeros(4)
        dist.all_reduce(send_tensor, op=torch_op)
        bagua.allreduce(send_tensor_bagua, recv_tensor_bagua, op=op, comm=comm)
        bagua.allreduce_inplace(send_tensor_bagua, op=op, comm=comm)
        check(f"allreduce {op.name}", send_tensor, recv_tensor_bagua)
        check(f"allreduce_inplace {op.name}", send_tensor, send_tensor_bagua)
    bits = torch.tensor([rank + 1, 6, 12], dtype=torch.int64)
    expected = bits.clone()
    dist.all_reduce(expected, op=dist.ReduceOp.BXOR)
    bagua.allreduce_inplace(bits, op=bagua.ReduceOp.BXOR, comm=comm)
    check("allreduce_inplace BXOR", expected, bits)

    # reduce
    dst = 1
    send_tensor = torch.rand(4)
    send_tensor_bagua = send_tensor.clone()
    recv_tensor_bagua = torch.zeros(4)
    dist.reduce(send_tensor, dst)
    bagua.reduce(send_tensor_bagua, recv_tensor_bagua, dst=dst, comm=comm)
    bagua.reduce_inplace(send_tensor_bagua, dst=dst, comm=comm)
    if rank == dst:
        check("reduce", send_tensor, recv_tensor_bagua)
        check("reduce_inplace", send_tensor, send_tensor_bagua)

    # allgather
    send_tensor = torch.rand(4)
    recv_tensor_bagua = torch.zeros(4 * nranks)
    recv_tensors = [torch.zeros(4) for _ in range(nranks)]
    dist.all_gather(recv_tensors, send_tensor)
    bagua.allgather(send_tensor, recv_tensor_bagua, comm=comm)
    check("allgather", torch.cat(recv_tensors), recv_tensor_bagua)

    # gather, scatter (gloo has both)
    send_tensor = torch.rand(3)
    gathered = [torch.zeros(3) for _ in range(nranks)] if rank == 0 else None
    gathered_bagua = torch.zeros(3 * nranks)
    dist.gather(send_tensor, gathered, dst=0)
    bagua.gather(send_tensor, gathered_bagua, 0, comm=comm)
    if rank == 0:
        check("gather", torch.cat(gathered), gathered_bagua)
    pieces = [torch.rand(3) for _ in range(nranks)]
    received, received_bagua = torch.zeros(3), torch.zeros(3)
    dist.scatter(received, pieces if rank == 0 else None, src=0)
    bagua.scatter(torch.cat(pieces), received_bagua, 0, comm=comm)
    check("scatter", received, received_bagua)

    # reduce_scatter
    send_tensors = [torch.rand(4) for _ in range(nranks)]
    recv_tensor_bagua = torch.zeros(4)
    expected = torch.stack(send_tensors)
    dist.all_reduce(expected)  # gloo has no reduce_scatter of a list: reduce everything, keep this rank's part
    bagua.reduce_scatter(torch.cat(send_tensors), recv_tensor_bagua, comm=comm)
    check("reduce_scatter", expected[rank], recv_tensor_bagua)

    # alltoall
    send_tensors = [torch.rand(4) for _ in range(nranks)]
    recv_tensors = [torch.zeros(4) for _ in range(nranks)]
    recv_tensor_bagua = torch.zeros(4 * nranks)
    dist.all_to_all(recv_tensors, send_tensors)
    bagua.alltoall(torch.cat(send_tensors), recv_tensor_bagua, comm=comm)
    check("alltoall", torch.cat(recv_tensors), recv_tensor_bagua)

    # alltoall_v with displacements: rank r sends r + 1 + j elements to rank j, from offset 2j
    send_counts = [rank + 1 + j for j in range(nranks)]
    recv_counts = [r + 1 + rank for r in range(nranks)]
    send_displs = [2 * j for j in range(nranks)]
    recv_displs = [sum(recv_counts[:r]) for r in range(nranks)]
    send_tensor = torch.arange(40, dtype=torch.float32) + 100 * rank
    packed = torch.cat([send_tensor[send_displs[j] : send_displs[j] + send_counts[j]] for j in range(nranks)])
    recv_tensor = torch.zeros(sum(recv_counts))
    dist.all_to_all_single(recv_tensor, packed, recv_counts, send_counts)
    recv_tensor_bagua = torch.zeros(sum(recv_counts))
    bagua.alltoall_v(send_tensor, send_counts, send_displs, recv_tensor_bagua, recv_counts, recv_displs, comm=comm)
    check("alltoall_v", recv_tensor, recv_tensor_bagua)

    # groups: from ranks and from a torch group
    group = bagua.communication.new_group(ranks=[0, 1])
    torch_group = dist.new_group(ranks=[0, 1])
    if rank in (0, 1):
        tensor = torch.full((2,), float(rank + 1))
        expected = tensor.clone()
        dist.all_reduce(expected, group=torch_group)
        bagua.allreduce_inplace(tensor, comm=group.get_global_communicator())
        check("allreduce on new_group", expected, tensor)
        from_torch = bagua.communication.from_torch_group(torch_group)
        tensor = torch.full((2,), float(rank + 1))
        bagua.allreduce_inplace(tensor, comm=from_torch.get_global_communicator())
        check("allreduce on from_torch_group", expected, tensor)

    bagua.barrier(comm=comm)
    if rank == 0:
        print("all primitives match torch.distributed", flush=True)


if __name__ == "__main__":
    main()
