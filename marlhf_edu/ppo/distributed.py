"""Data-parallel PPO: what each rank does alone, and what must be the same on every rank.

    accelerate launch --config_file configs/accelerate/ddp_4gpu.yaml -m marlhf_edu.cli ma-ppo --config ...

Every rank holds the whole engine (its own NF4 base on its own GPU) and the same weights. One step:

1. each rank samples, scores and evaluates (old/ref log-probs, values) its contiguous shard of the global batch;
2. the shards' experience is all-gathered: every (B, P + R) and (B, R) tensor of the rollout, a few kB per row.
   Everything that is a batch statistic — score whitening and baselines, advantage whitening, the KL the
   controller sees, the logged means — is then computed on the global batch, identically on every rank;
3. each global minibatch is split into one contiguous part per rank; each rank runs its part's forward and
   backward, the gradients of the trainable adapters and heads are averaged across ranks (one all-reduce per
   optimizer step), and every rank takes the same optimizer step. Whether a minibatch is skipped (ratio
   threshold) and whether the epochs stop early are decided on the gathered statistics, so no rank can skip
   alone (a rank that did would wait forever in the next all-reduce).

Why not `torch.nn.parallel.DistributedDataParallel`: the trainable set is a few adapters that different forwards
use in turn (policy, value), and one optimizer step accumulates several micro-batches. DDP's per-backward
all-reduce would need `find_unused_parameters` and `no_sync`; one averaged all-reduce of the gradients per
optimizer step is the same arithmetic with fewer moving parts (DDP's advantage, overlapping communication with
the backward, is small next to generation, which is most of a PPO step).

A 2-rank run equals a 1-process run on the same global batch when the sampling does not depend on how the batch
is split (`rollout_seeding: per_chunk`) and the chunks line up (tests/test_distributed.py). Taught in chapter 14.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

#: Gradients are all-reduced in buckets of at most this many elements, so no full flat copy of a 7B LoRA's
#: gradients is ever made (r = 64 on q/k/v/o of Llama-2-7B: 67 M parameters, 268 MB in fp32).
BUCKET_ELEMENTS = 16 * 2**20


@dataclass
class DataParallel:
    """This process's place in a data-parallel run (rank 0 of 1 when not launched by `accelerate launch`)."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def from_environment(cls, device="cpu") -> "DataParallel":
        """Join the run that `accelerate launch` / `torchrun` started (WORLD_SIZE > 1 in the environment):
        accelerate's `PartialState` opens the process group (NCCL on CUDA, gloo on CPU) and binds the GPU."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return cls()
        import torch.distributed as dist

        if not dist.is_initialized():
            from accelerate import PartialState

            PartialState(cpu=torch.device(device).type == "cpu")
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, rows: list) -> list:
        """This rank's contiguous share of `rows` (its length must divide evenly)."""
        n = len(rows) // self.world_size
        return rows[self.rank * n:(self.rank + 1) * n]

    # ---- collectives (each a no-op on one process) ------------------------------------------

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    def max_int(self, value: int) -> int:
        """The largest `value` over the ranks (prompt and response widths, so every shard pads alike)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self._comm_device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t)

    def any(self, flag: bool) -> bool:
        return self.max_int(int(flag)) > 0

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """(n, ...) on every rank → (world · n, ...), rank 0's rows first: the global batch, on every rank."""
        if not self.enabled:
            return tensor
        dtype = tensor.dtype
        x = tensor.to(self._comm_device(), torch.uint8 if dtype == torch.bool else dtype).contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x)
        return torch.cat(parts).to(tensor.device, dtype)

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Replace each parameter's gradient by its mean over the ranks, bucket by bucket.

        Every rank computes gradients for the same parameters in the same order, so the buckets line up; a
        parameter without a gradient contributes zeros (and keeps None when every rank has none)."""
        if not self.enabled:
            return
        params = [p for p in params if p.requires_grad]
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=self._comm_device())
        torch.distributed.all_reduce(has, op=torch.distributed.ReduceOp.MAX)
        live = [p for p, h in zip(params, has.tolist()) if h]
        for p in live:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        start = 0
        while start < len(live):
            bucket, size = [], 0
            while start < len(live) and (not bucket or size + live[start].numel() <= BUCKET_ELEMENTS):
                bucket.append(live[start]); size += live[start].numel(); start += 1
            flat = torch.cat([p.grad.reshape(-1).float() for p in bucket])
            torch.distributed.all_reduce(flat)
            flat /= self.world_size
            for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad.copy_(g.view_as(p.grad))

    def broadcast_parameters(self, params: list[torch.nn.Parameter]) -> None:
        """Rank 0's values into every rank's copy: all ranks start from the same trainable weights."""
        if not self.enabled:
            return
        with torch.no_grad():
            for p in params:
                t = p.data.to(self._comm_device())
                torch.distributed.broadcast(t, src=0)
                p.data.copy_(t)

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        """Leave the process group (the end of a run), so torch does not warn about it at exit."""
        if self.enabled and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def _comm_device(self) -> torch.device:
        # NCCL moves CUDA tensors only; gloo moves CPU tensors
        if torch.distributed.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def left_pad_to(ids: torch.Tensor, mask: torch.Tensor, width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) left-padded prompts → (B, width): more left padding, so every rank's shard has the global width."""
    extra = width - ids.shape[1]
    if extra <= 0:
        return ids, mask
    return (torch.nn.functional.pad(ids, (extra, 0), value=pad_id), torch.nn.functional.pad(mask, (extra, 0), value=0))


def chunk_seed(seed: int, step: int, chunk: int) -> int:
    """The sampling seed of forward chunk `chunk` (counted over the global batch) at step `step`
    (`rollout_seeding: per_chunk`): the same whichever rank samples that chunk."""
    return (seed * 1_000_003 + step) * 65_537 + chunk
