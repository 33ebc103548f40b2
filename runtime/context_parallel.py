"""Context parallelism (Strategy.cp): each sequence split over the cp ranks of its dp rank.

What a cp rank holds and sends, per micro-batch (as `cost_models.collectives` prices it):
- ring (`cp_kind="ring"`): the sequence is cut into 2·cp chunks and rank r keeps chunks r and
  2·cp-1-r (the early, cheap causal rows paired with the late, expensive ones). Each attention
  call runs `RingAttention`: cp-1 rounds in which every rank sends its current K and V blocks to
  the next cp rank and receives the previous rank's, attending to each block as it arrives (the
  next block's transfer in flight meanwhile) and merging blocks by their log-sum-exp in fp32.
  The backward rotates K and V again (cp-1 rounds) and sends the dK and dV accumulators along
  with them, cp times, the last bringing them home; it recomputes each block's probabilities
  from the saved log-sum-exp (as FlashAttention's backward does), so no block's scores are kept.
  Of another rank's block only the half the causal mask leaves is computed (`_visible`).
- ulysses (`cp_kind="ulysses"`): the sequence is cut into cp contiguous chunks. Q, K and V go
  from sequence shards to head shards by all-to-all, attention runs on the whole sequence for
  heads/cp heads, and the output goes back by a fourth; their backward is the transposed four.
- recompute: a fully recomputed layer repeats its forward's exchange (cp-1 K/V rounds, or the four
  all-to-alls) in backward; selective recompute keeps attention's results and repeats none (the
  all-to-alls are saved functional collectives, the ring keeps its output, `_selective_pass`).
The causal mask follows the tokens' global positions, which the zoo models also read for their
position embeddings (`position_ids`, set here per micro-batch). The zoo's attention calls
`attend(q, k, v)`; `apply_context_parallel` replaces it per instance, so a model outside a cp
plan runs as it always did.

The loss is the one-process number: each rank takes the next token of the whole sequence as its
positions' targets (the last position has none) and its loss is cp x (its token losses' sum) /
(the micro-batch's target count), so the mean over the dp x cp ranks, which the gradient sync
takes (`RankLayout.gradient_mesh`), is the micro-batch's mean.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

from autopar.capabilities import context_parallel_strategy_problem
from autopar.runtime.expert_parallel import _all_to_all

IGNORE = -100  # F.cross_entropy's ignore_index: the last position has no next token


# --- which positions a rank holds -------------------------------------------------------------

def shard_positions(seq_len: int, cp: int, rank: int, kind: str) -> torch.Tensor:
    """Global positions of the tokens cp rank `rank` holds, in the order it holds them."""
    if kind == "ulysses":
        chunk = seq_len // cp
        return torch.arange(rank * chunk, (rank + 1) * chunk)
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat((torch.arange(first, first + chunk), torch.arange(second, second + chunk)))


def context_parallel_problem(model: nn.Module, strategy, seq_len: int | None = None, loss_fn=None,
                             tp_realization: str = "modules") -> str | None:
    """Why `strategy`'s context parallelism cannot run on `model` (before any collective), or None:
    what the parity tests cover is what runs (tests/test_context_parallel.py)."""
    from autopar.models import lm_loss
    from autopar.models.gpt import GPT, CausalSelfAttention
    from autopar.models.llama import Llama

    s = strategy
    if s.cp <= 1:
        return None
    if not isinstance(model, (GPT, Llama)):
        return "context parallelism runs the zoo's gpt and llama models only (their attention and positions)"
    config = model.config
    if config.moe_experts:
        return "context parallelism runs dense models only: the zoo's MoE blocks are not sequence-sharded"
    if config.dropout > 0:
        return "context-parallel attention has no dropout: build the model with dropout=0"
    reason = context_parallel_strategy_problem(s)
    if reason:
        return reason
    if s.tp > 1 and tp_realization != "modules":
        return "context parallelism runs with the module rules' tensor parallelism, not DTensor's"
    if loss_fn is not None and loss_fn is not lm_loss:
        return "context parallelism computes the zoo's next-token loss (autopar.models.lm_loss) on sequence shards"
    heads, kv_heads = config.heads // s.tp, config.num_kv_heads // s.tp
    if s.cp_kind == "ulysses" and (heads % s.cp or kv_heads % s.cp):
        return (f"ulysses cp={s.cp} splits each tp rank's {heads} heads and {kv_heads} kv heads: cp must divide "
                f"both (or use cp_kind=ring)")
    if any(not isinstance(m, CausalSelfAttention) for m in model.modules() if "attn" in type(m).__name__.lower()):
        return "context parallelism replaces the zoo's CausalSelfAttention only"
    if seq_len is not None:
        parts = 2 * s.cp if s.cp_kind == "ring" else s.cp
        if seq_len % parts:
            return (f"{s.cp_kind} context parallelism cuts each sequence into {parts} equal chunks: the sequence "
                    f"length {seq_len} is not divisible by {parts}")
    return None


# --- the step's side: shards, positions, loss ----------------------------------------------------

@dataclass
class ContextParallel:
    """This rank's place in its cp group and what its forward and loss need."""

    cp: int
    kind: str
    rank: int
    group: dist.ProcessGroup

    def shard(self, model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's tokens, their targets) of a micro-batch of whole sequences [batch, seq];
        sets the model's `position_ids` to their global positions."""
        seq_len = tokens.shape[1]
        positions = shard_positions(seq_len, self.cp, self.rank, self.kind).to(tokens.device)
        following = torch.cat((tokens[:, 1:], torch.full_like(tokens[:, :1], IGNORE)), dim=1)
        model.position_ids = positions
        return tokens[:, positions], following[:, positions]

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, seq_len: int) -> torch.Tensor:
        """cp x this rank's token-loss sum over the micro-batch's target count (see the module docstring)."""
        vocab = logits.shape[-1]
        total = F.cross_entropy(logits.reshape(-1, vocab).float(), targets.reshape(-1), ignore_index=IGNORE,
                                reduction="sum")
        return total * (self.cp / (targets.shape[0] * (seq_len - 1)))


def apply_context_parallel(module: nn.Module, layout, strategy) -> ContextParallel:
    """Swap every zoo attention's `attend` for the cp kind's (on this rank's copy of the model)."""
    from autopar.models.gpt import CausalSelfAttention

    context = ContextParallel(strategy.cp, strategy.cp_kind, layout.cp_rank, layout.group("cp"))
    for sub in module.modules():
        if isinstance(sub, CausalSelfAttention):
            sub.attend = (functools.partial(ring_attention, context, kept=collections.deque())
                          if context.kind == "ring" else functools.partial(ulysses_attention, context))
    return context


# --- ring attention ------------------------------------------------------------------------------

def _ring_peers(context: ContextParallel) -> tuple[int, int]:
    """Group ranks of the next and the previous cp rank."""
    return (context.rank + 1) % context.cp, (context.rank - 1) % context.cp


def _start_exchange(tensors: list[torch.Tensor], context: ContextParallel, first_tag: int = 0
                    ) -> tuple[list[torch.Tensor], list]:
    """Send each tensor to the next cp rank and receive as many from the previous, asynchronously;
    (buffers, in flight). Tags tell concurrent exchanges apart (K/V blocks and gradient accumulators)."""
    send_to, receive_from = _ring_peers(context)
    sent = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in sent]
    requests = []
    for tag, (tensor, buffer) in enumerate(zip(sent, received), start=first_tag):
        requests.append(dist.isend(tensor, group=context.group, group_dst=send_to, tag=tag))
        requests.append(dist.irecv(buffer, group=context.group, group_src=receive_from, tag=tag))
    return received, (requests, sent)


def _finish(in_flight) -> None:
    requests, _sent = in_flight  # the sent tensors stay referenced until their sends complete
    for request in requests:
        request.wait()


def _expand_kv(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=1)


def _fold_kv(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_expand_kv`: each kv head's query group summed."""
    if groups == 1:
        return tensor
    batch, heads, seq, dim = tensor.shape
    return tensor.view(batch, heads // groups, groups, seq, dim).sum(2)


def _selective_pass() -> str | None:
    """"forward" or "recompute" inside a layer under selective recompute (`runtime.recompute`), else None.

    Selective recompute keeps attention's results and resends no collective (as it keeps SDPA's and
    the functional collectives'); a ring block's exchange is plain P2P, which torch's selective
    checkpoint would replay. So the ring's forward runs beside the checkpoint's caching mode (its
    ops neither cached nor counted there), keeps its output and log-sum-exp, and the recompute takes
    them back instead of computing and sending again. The modes are torch's (2.11-2.13) own."""
    mode = _get_current_dispatch_mode()
    if isinstance(mode, _CachingTorchDispatchMode):
        return "forward"
    if isinstance(mode, _CachedTorchDispatchMode):
        return "recompute"
    return None


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over every cp rank's keys (see the module docstring).
    `kept`: this attention's (output, log-sum-exp) between a selective forward and its recompute."""

    @staticmethod
    def forward(ctx, q, k, v, context: ContextParallel, kept: collections.deque):
        selective = _selective_pass()
        if selective == "recompute":
            if not kept:
                raise RuntimeError("ring attention recomputed without a kept forward: the checkpointed layer ran "
                                   "its forward and recompute in different orders")
            out, lse = kept.popleft()
        else:
            # fp32 scores and log-sum-exp whatever autocast would choose for the matmuls
            with _pop_mode_temporarily() if selective == "forward" else contextlib.nullcontext(), \
                    torch.autocast(q.device.type, enabled=False):
                out, lse = _ring_forward(q, k, v, context)
            if selective == "forward":
                kept.append((out, lse))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.context, ctx.scale, ctx.groups = context, 1.0 / math.sqrt(q.shape[-1]), q.shape[1] // k.shape[1]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return (*_ring_backward(ctx, grad_out), None, None)


def _visible(rank: int, owner: int, chunk: int) -> tuple[slice, slice, bool]:
    """(this rank's query rows, the block's key rows, whether the causal mask cuts inside them):
    what can meet when rank `rank`'s queries (chunks r, 2cp-1-r) see rank `owner`'s keys. An earlier
    rank's block is seen whole through its first chunk only, a later rank's by the second query
    chunk only: half a block each, unmasked (the zigzag's balance); its own block needs the mask."""
    if owner == rank:
        return slice(None), slice(None), True
    if owner < rank:
        return slice(None), slice(0, chunk), False
    return slice(chunk, None), slice(None), False


def _block_scores(q, k, q_pos, k_pos, scale, masked):
    """fp32 scores of q over K rows, -inf where the key follows the query (when `masked`)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf")) if masked else scores


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: ContextParallel
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output in q's dtype, fp32 log-sum-exp per query) over the K/V blocks as they come round."""
    cp, rank = context.cp, context.rank
    chunk, seq_len = q.shape[2] // 2, q.shape[2] * cp
    scale, groups = 1.0 / math.sqrt(q.shape[-1]), q.shape[1] // k.shape[1]
    q_pos = shard_positions(seq_len, cp, rank, "ring").to(q.device)
    block_k, block_v = k, v
    lse = out = None
    for step in range(cp):
        pending = _start_exchange([block_k, block_v], context) if step < cp - 1 else None
        owner = (rank - step) % cp
        rows, keys, masked = _visible(rank, owner, chunk)
        k_pos = shard_positions(seq_len, cp, owner, "ring").to(q.device)[keys]
        scores = _block_scores(q[:, :, rows], _expand_kv(block_k[:, :, keys], groups), q_pos[rows],
                                          k_pos, scale, masked)
        values = _expand_kv(block_v[:, :, keys], groups).float()
        if out is None:  # this rank's own block first: every query sees itself, so the lse is finite
            lse = torch.logsumexp(scores, dim=-1)
            out = torch.matmul(torch.exp(scores - lse[..., None]), values)
        else:  # merge by log-sum-exp (fp32), only the rows this block reaches
            merged = torch.logaddexp(lse[:, :, rows], torch.logsumexp(scores, dim=-1))
            out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - merged)[..., None]
                               + torch.matmul(torch.exp(scores - merged[..., None]), values))
            lse[:, :, rows] = merged
        if pending is not None:
            (block_k, block_v), requests = pending
            _finish(requests)
    return out.to(q.dtype), lse


def _ring_backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): K/V go round again, their gradient accumulators with them and home at the end;
    each block's probabilities recomputed from the saved log-sum-exp."""
    q, k, v, out, lse = ctx.saved_tensors
    context, scale, groups = ctx.context, ctx.scale, ctx.groups
    cp, rank = context.cp, context.rank
    chunk, seq_len = q.shape[2] // 2, q.shape[2] * cp
    q_pos = shard_positions(seq_len, cp, rank, "ring").to(q.device)
    grad_out = grad_out.float()
    delta = (grad_out * out.float()).sum(-1, keepdim=True)  # rowsum(dO · O)
    grad_q = torch.zeros_like(q, dtype=torch.float32)
    block_k, block_v = k, v
    grad_k = grad_v = None  # the accumulators travelling with the block (K/V's dtype)
    for step in range(cp):
        pending = _start_exchange([block_k, block_v], context) if step < cp - 1 else None
        owner = (rank - step) % cp
        rows, keys, masked = _visible(rank, owner, chunk)
        k_pos = shard_positions(seq_len, cp, owner, "ring").to(q.device)[keys]
        wide_k = _expand_kv(block_k[:, :, keys], groups).float()
        wide_v = _expand_kv(block_v[:, :, keys], groups).float()
        q_rows, grad_rows = q[:, :, rows].float(), grad_out[:, :, rows]
        probs = torch.exp(_block_scores(q_rows, wide_k, q_pos[rows], k_pos, scale, masked)
                          - lse[:, :, rows, None])
        grad_scores = probs * (torch.matmul(grad_rows, wide_v.transpose(-1, -2)) - delta[:, :, rows]) * scale
        grad_q[:, :, rows] += torch.matmul(grad_scores, wide_k)
        block_grad_k = torch.zeros_like(block_k, dtype=torch.float32)
        block_grad_v = torch.zeros_like(block_v, dtype=torch.float32)
        block_grad_k[:, :, keys] = _fold_kv(torch.matmul(grad_scores.transpose(-1, -2), q_rows), groups)
        block_grad_v[:, :, keys] = _fold_kv(torch.matmul(probs.transpose(-1, -2), grad_rows), groups)
        if grad_k is not None:  # what the block's earlier holders added, received last step
            block_grad_k, block_grad_v = block_grad_k + grad_k.float(), block_grad_v + grad_v.float()
        # the accumulators move on with their block (K/V's dtype): the cp-th send brings them home
        (grad_k, grad_v), accumulators = _start_exchange([block_grad_k.to(k.dtype), block_grad_v.to(v.dtype)],
                                                         context, first_tag=2)
        if pending is not None:
            (block_k, block_v), requests = pending
            _finish(requests)
        _finish(accumulators)
    return grad_q.to(q.dtype), grad_k, grad_v


def ring_attention(context: ContextParallel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   kept: collections.deque | None = None) -> torch.Tensor:
    """The zoo attention's `attend` under ring cp: q [batch, heads, seq/cp, dim], k/v with kv heads.
    `kept`: one per attention module, for selective recompute (see `_selective_pass`)."""
    return RingAttention.apply(q, k, v, context, collections.deque() if kept is None else kept)


# --- Ulysses -------------------------------------------------------------------------------------

def _sequence_to_heads(x: torch.Tensor, context: ContextParallel) -> torch.Tensor:
    """[batch, heads, seq/cp, dim] -> [batch, heads/cp, seq, dim]: rank j receives heads j·heads/cp..."""
    batch, heads, local, dim = x.shape
    cp = context.cp
    chunks = x.reshape(batch, cp, heads // cp, local, dim).transpose(0, 1)  # [cp (destination), ...]
    received = _all_to_all(chunks, context.group)  # [cp (source: its sequence chunk), batch, heads/cp, local, dim]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // cp, cp * local, dim)


def _heads_to_sequence(x: torch.Tensor, context: ContextParallel) -> torch.Tensor:
    """[batch, heads/cp, seq, dim] -> [batch, heads, seq/cp, dim] (the inverse of `_sequence_to_heads`)."""
    batch, heads, seq, dim = x.shape
    cp = context.cp
    chunks = x.reshape(batch, heads, cp, seq // cp, dim).permute(2, 0, 1, 3, 4)  # [cp (destination), ...]
    received = _all_to_all(chunks, context.group)  # [cp (source: its heads), batch, heads/cp, seq/cp, dim]
    return received.transpose(0, 1).reshape(batch, cp * heads, seq // cp, dim)


def ulysses_attention(context: ContextParallel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The zoo attention's `attend` under Ulysses cp: four all-to-alls around whole-sequence attention."""
    q, k, v = (_sequence_to_heads(t, context) for t in (q, k, v))
    if k.shape[1] != q.shape[1]:
        groups = q.shape[1] // k.shape[1]
        k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _heads_to_sequence(out, context)
