"""SGLang's speculative-verify mask metadata: `custom_mask` and `mask_indptr`.

In SGLang 0.5.17's target-verify step (Triton backend, `TreeMaskMode.FULL_MASK`) each
request b owns one flattened, row-major bool block of shape
``[q_len_b, prefix_len_b + q_len_b]`` that starts at ``mask_indptr[b]``::

    mask_indptr = [0, cumsum(q_len_b * (prefix_len_b + q_len_b))]     (int64, [B + 1])
    row t, column j  ->  custom_mask[mask_indptr[b] + t * (prefix_len_b + q_len_b) + j]

Columns ``0 .. prefix_len_b-1`` are the committed context; the last ``q_len_b`` columns
are the draft tokens being verified. `extend_attention_fwd` is called with
``skip_prefix_custom_mask=True``, so the kernel never reads the prefix columns (they are
all True here, and SGLang may even leave them unwritten with ``fill_prefix_mask=False``);
only the ``[q_len_b, q_len_b]`` draft block decides anything. See
sglang/kernels/ops/attention/extend_attention.py (`_fwd_kernel`, stage 2),
sglang/srt/layers/attention/triton_backend.py (`seq_mask_len = num_draft_tokens *
(seq_lens + num_draft_tokens)`) and sglang/kernels/ops/speculative/spec_tree.py (the
EAGLE tree: a token sees the root, its ancestors and itself).

`prefix_lens` / `q_lens` below take a Python int (one request), a sequence of ints, or a
1-D integer tensor. A scalar `q_lens` is broadcast over the requests.
"""
from __future__ import annotations

from typing import Sequence

import torch

IntsLike = int | Sequence[int] | torch.Tensor


def _as_int_list(name: str, value: IntsLike) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.dim() > 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(f"{name}: expected a 1-D integer tensor, got {value.dtype} {tuple(value.shape)}")
        value = value.reshape(-1).tolist()
    elif isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    try:
        out = [int(v) for v in value]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: expected ints, got {value!r}") from e
    if any(isinstance(v, bool) for v in value) or any(int(v) != v for v in value):
        raise ValueError(f"{name}: expected ints, got {value!r}")
    return out


def check_lengths(prefix_lens: IntsLike, q_lens: IntsLike) -> tuple[list[int], list[int]]:
    """Validated per-request (prefix_lens, q_lens) as int lists; a single q_len is broadcast."""
    prefix = _as_int_list("prefix_lens", prefix_lens)
    q = _as_int_list("q_lens", q_lens)
    if not prefix:
        raise ValueError("prefix_lens: need at least one request")
    if len(q) == 1 and len(prefix) > 1:
        q = q * len(prefix)
    if len(q) != len(prefix):
        raise ValueError(f"q_lens: {len(q)} entries for {len(prefix)} requests in prefix_lens")
    if any(p < 0 for p in prefix):
        raise ValueError(f"prefix_lens: negative length in {prefix}")
    if any(t < 0 for t in q):
        raise ValueError(f"q_lens: negative length in {q}")
    return prefix, q


def mask_indptr_for(prefix_lens: IntsLike, q_lens: IntsLike, device=None) -> torch.Tensor:
    """[B+1] int64 offsets: 0, then cumsum(q_len * (prefix_len + q_len)) (SGLang's formula)."""
    prefix, q = check_lengths(prefix_lens, q_lens)
    sizes = torch.tensor([t * (p + t) for p, t in zip(prefix, q)], dtype=torch.int64)
    indptr = torch.zeros(len(prefix) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(sizes, 0)
    return indptr.to(device) if device is not None else indptr


def causal_chain_draft_block(q_len: int) -> torch.Tensor:
    """[q_len, q_len] lower-triangular (incl. diagonal): draft t sees drafts 0..t (DFlash)."""
    return torch.ones(q_len, q_len, dtype=torch.bool).tril()


def random_tree_parents(q_len: int, generator: torch.Generator | None = None) -> list[int]:
    """A random draft tree: parents[0] = -1 (the root), parents[i] uniform in 0..i-1."""
    parents = [-1]
    for i in range(1, q_len):
        parents.append(int(torch.randint(0, i, (1,), generator=generator).item()))
    return parents


def tree_draft_block(parents: Sequence[int]) -> torch.Tensor:
    """[q_len, q_len] block where draft i sees itself and all its ancestors.

    `parents[i]` must be < i (SGLang orders tree nodes so a parent precedes its
    children), -1 for the root.
    """
    q_len = len(parents)
    block = torch.zeros(q_len, q_len, dtype=torch.bool)
    for i, p in enumerate(parents):
        if not (p == -1 if i == 0 else 0 <= p < i):
            raise ValueError(f"parents: parents[{i}] = {p}; need -1 for node 0 and 0 <= p < i otherwise")
        block[i, i] = True
        if p >= 0:
            block[i] |= block[p]
    return block


def mask_from_draft_blocks(prefix_lens: IntsLike, blocks: Sequence[torch.Tensor],
                           device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(custom_mask, mask_indptr) from per-request [q_len_b, q_len_b] draft blocks.

    Prefix columns are all True. custom_mask is 1-D bool, mask_indptr [B+1] int64.
    """
    q_lens = [int(b.shape[0]) for b in blocks]
    prefix, q = check_lengths(prefix_lens, q_lens)
    parts = []
    for p, t, blk in zip(prefix, q, blocks):
        if blk.shape != (t, t):
            raise ValueError(f"blocks: expected a square [q_len, q_len] block, got {tuple(blk.shape)}")
        rows = torch.ones(t, p + t, dtype=torch.bool)
        rows[:, p:] = blk.to(torch.bool).cpu()
        parts.append(rows.reshape(-1))
    custom_mask = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)
    indptr = mask_indptr_for(prefix, q)
    if device is not None:
        custom_mask, indptr = custom_mask.to(device), indptr.to(device)
    return custom_mask, indptr


def causal_chain_mask(prefix_lens: IntsLike, q_lens: IntsLike,
                      device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(custom_mask, mask_indptr) for a linear draft chain: draft t sees drafts 0..t.

    This is what DFlash verifies; it equals passing no custom_mask to a causal kernel.
    """
    prefix, q = check_lengths(prefix_lens, q_lens)
    return mask_from_draft_blocks(prefix, [causal_chain_draft_block(t) for t in q], device)


def random_tree_mask(prefix_lens: IntsLike, q_lens: IntsLike,
                     generator: torch.Generator | int | None = None,
                     device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(custom_mask, mask_indptr) for random draft trees, as NGRAM/EAGLE verify them.

    Each draft token i > 0 gets a uniformly random parent among 0..i-1 and sees its
    ancestors and itself; draft 0 (the root, the last verified token) sees itself.
    `generator` is a CPU torch.Generator or an int seed (None: torch's global RNG).
    """
    prefix, q = check_lengths(prefix_lens, q_lens)
    if isinstance(generator, int) and not isinstance(generator, bool):
        generator = torch.Generator().manual_seed(generator)
    elif generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: a torch.Generator, an int seed or None, got {generator!r}")
    blocks = [tree_draft_block(random_tree_parents(t, generator)) for t in q]
    return mask_from_draft_blocks(prefix, blocks, device)


def draft_block(custom_mask: torch.Tensor, mask_indptr: torch.Tensor, b: int,
                prefix_len: int, q_len: int) -> torch.Tensor:
    """Request b's [q_len, q_len] draft block of a flattened custom_mask (a view, no copy)."""
    return request_rows(custom_mask, mask_indptr, b, prefix_len, q_len)[:, prefix_len:]


def mask_to_text(block: torch.Tensor, on: str = "#", off: str = ".") -> str:
    """A small bool matrix as text rows (for notebooks: deterministic, easy to read)."""
    return "\n".join("".join(on if v else off for v in row) for row in block.bool().tolist())


def request_rows(custom_mask: torch.Tensor, mask_indptr: torch.Tensor, b: int,
                 prefix_len: int, q_len: int) -> torch.Tensor:
    """Request b's full [q_len, prefix_len + q_len] mask rows (prefix columns included)."""
    if custom_mask.dim() != 1:
        raise ValueError(f"custom_mask: expected 1-D, got shape {tuple(custom_mask.shape)}")
    requests = mask_indptr.numel() - 1
    if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < requests:
        raise ValueError(f"b: a request index in 0..{requests - 1}, got {b!r}")
    start, end = int(mask_indptr[b]), int(mask_indptr[b + 1])
    width = prefix_len + q_len
    if q_len < 1 or prefix_len < 0 or end - start != q_len * width:
        # a wrong length would reshape the flat mask into shifted, meaningless rows
        raise ValueError(f"prefix_len, q_len: request {b} holds {end - start} mask elements, not q_len x "
                         f"(prefix_len + q_len) = {q_len} x {width}")
    if end > custom_mask.numel():
        raise ValueError(f"custom_mask: request {b} needs elements up to {end}, mask has {custom_mask.numel()}")
    return custom_mask[start:end].view(q_len, width)


def mask_heatmap(rows_by_name: dict[str, torch.Tensor], prefix_len: int):
    """Altair heatmap of [q_len, prefix_len + q_len] mask rows, one panel per name.

    Cells: query token (rows) x key (columns); prefix keys and draft keys colored apart.
    """
    import altair as alt
    import pandas as pd

    records = []
    for name, rows in rows_by_name.items():
        for t, row in enumerate(rows.bool().tolist()):
            for j, seen in enumerate(row):
                region = "prefix" if j < prefix_len else "draft"
                records.append({"mask": name, "query": t, "key": j,
                                "visible": f"{region} key, visible" if seen else "hidden"})
    df = pd.DataFrame(records)
    colors = alt.Scale(domain=["prefix key, visible", "draft key, visible", "hidden"],
                       range=["#9ecae1", "#08519c", "#f0f0f0"])
    return (
        alt.Chart(df)
        .mark_rect(stroke="white", strokeWidth=1)
        .encode(x=alt.X("key:O", title="key (prefix, then drafts)"),
                y=alt.Y("query:O", title="draft query token"),
                color=alt.Color("visible:N", scale=colors, title=None),
                tooltip=["mask", "query", "key", "visible"])
        .properties(width=220, height=140)
        .facet(column=alt.Column("mask:N", title=None))
    )
