"""Where vLLM's C++ CPU attention puts each key and value element inside a KV page.

The position-free CPU backend keeps vLLM's stock page (``engine_ext/attention/cpu_backend.py``):
per (block, kv head), ``block_size * head_size`` key elements then as many value elements, each
in the layout ``cpu_attn_reshape_and_cache`` writes for the CPU's ISA (column-major keys for the
vector kernels, quad-word-packed token groups for AMX, ...). Reading a block *off* its home slot
the keys rotated by the slot difference, so the layout must be known.

Rather than re-implementing each ISA's packing (which vLLM may change in any release), the
layout is *measured*: vLLM's own writer stores probe keys whose values encode their (token, dim)
index, base-16 digit by digit (every digit + 1 <= 16 is exact in bf16/fp16), and reading the
page back gives the permutation. A layout that is not a permutation of the page (a packing that
pads, quantises or duplicates) stops the engine: the backend cannot read such keys back.

"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

_DIGIT_BASE = 16


@dataclass(frozen=True)
class PageLayout:
    """Permutations between plain ``[block_size * head_size]`` rows and a page's K / V region.

    (Regions here are the two halves of vLLM's stock page: keys, then values.)

    ``plain = region[..., *_gather]`` and ``region = plain[..., *_scatter]``, on the last
    dimension of ``[..., block_size * head_size]`` views.
    """

    block_size: int
    head_size: int
    key_gather: torch.Tensor
    key_scatter: torch.Tensor
    value_gather: torch.Tensor
    value_scatter: torch.Tensor

    def plain_keys(self, key_region: torch.Tensor) -> torch.Tensor:
        """``[n, heads, bs * D]`` page keys -> ``[n, heads, bs, D]`` plain keys."""
        flat = key_region.reshape(*key_region.shape[:2], -1)
        return flat[..., self.key_gather].view(*flat.shape[:2], self.block_size,
                                                self.head_size)

    def packed_keys(self, plain: torch.Tensor) -> torch.Tensor:
        """``[n, heads, bs, D]`` plain keys -> ``[n, heads, bs * D]`` in the page's layout."""
        return plain.reshape(*plain.shape[:2], -1)[..., self.key_scatter]

    def plain_values(self, value_region: torch.Tensor) -> torch.Tensor:
        """``[n, heads, bs * D]`` page values -> ``[n, heads, bs, D]`` plain values."""
        flat = value_region.reshape(*value_region.shape[:2], -1)
        return flat[..., self.value_gather].view(*flat.shape[:2], self.block_size,
                                                  self.head_size)


    def token_keys(self, key_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Keys of ``blocks`` as plain token rows ``[len(blocks) * bs, heads * D]``.

        The row order of vLLM's rotary op and writer (token, then head, then dim), read from
        the packed pages. Every off-home fill reads its blocks through here (30 layers x every
        block of a reused span), so the copy is the fast one for the layout: a strided
        transpose when the page is ``[D, bs]`` (the vector kernels' column-major keys), else
        one flat ``index_select``. Both are exact copies; the first version (``key_cache[blocks]``
        then a gather on the page dimension) took 9.5 ms per layer for 256 blocks on the
        2-core box (``benchmarks/ttft_bound.py`` found it: ~30% of an 8k cached final).
        """
        heads = key_cache.shape[1]
        n = blocks.numel()
        # the cache is a strided view (keys then values per head): one copy of the blocks read
        pages = key_cache.index_select(0, blocks)  # contiguous [n, heads, bs, D]
        if self.column_major_keys():
            # contiguous(): for one block the reshape is a strided view, and vLLM's rotary op
            # and writer need dense rows
            return pages.view(n, heads, self.head_size, self.block_size).permute(
                0, 3, 1, 2).contiguous().view(n * self.block_size, heads * self.head_size)
        page = pages[0].numel() if n else 0
        index = (torch.arange(n).unsqueeze(1) * page
                 + self._token_major(heads).unsqueeze(0)).flatten()
        return pages.reshape(-1).index_select(0, index).view(-1, heads * self.head_size)

    def tokens_at(self, pages: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values ``[n, heads, D]`` of the tokens ``(blocks[i], offsets[i])`` of a
        layer's pages ``[B, heads, 2 * bs, D]``, one gather each, straight from the cache.

        Possible where the layout is a plain matrix (keys ``[D, bs]`` or ``[bs, D]``, values
        ``[bs, D]``: the vector kernels'), else None (read whole pages, then reorder). Why:
        picking a prompt's real keys out of its pages this way took 0.13 ms per layer for
        1,024 keys against 0.49 ms for pages, token order, then the pick (2-core box, SmolLM2
        heads, fp32).
        """
        kind = self._matrix_keys()
        if kind is None:
            return None
        b, h = pages.shape[:2]
        bs, d = self.block_size, self.head_size
        key_region, value_region = pages[:, :, :bs], pages[:, :, bs:]
        if kind == "columns":
            keys = key_region.view(b, h, d, bs)[blocks, :, :, offsets]
        else:
            keys = key_region[blocks, :, offsets]
        return keys.contiguous(), value_region[blocks, :, offsets].contiguous()

    @functools.cache  # noqa: B019 (a handful of layouts, alive for the whole process)
    def _matrix_keys(self) -> str | None:
        """"columns" (keys ``[D, bs]``) or "rows" (``[bs, D]``) when values are ``[bs, D]``
        rows; None when either region is packed otherwise."""
        plain = torch.arange(self.block_size * self.head_size)
        if not torch.equal(self.value_gather, plain):
            return None
        if self.column_major_keys():
            return "columns"
        return "rows" if torch.equal(self.key_gather, plain) else None

    @functools.cache  # noqa: B019 (a handful of layouts; asked per layer on the masked path)
    def column_major_keys(self) -> bool:
        """Whether the key page is plain ``[D, bs]``: key ``(t, d)`` at page cell ``d*bs + t``."""
        transpose = torch.arange(self.block_size * self.head_size).view(
            self.head_size, self.block_size).t().flatten()
        return torch.equal(self.key_gather, transpose)

    @functools.cache  # noqa: B019 (a handful of layouts, alive for the whole process)
    def _token_major(self, heads: int) -> torch.Tensor:
        """Index into a block's ``[heads * bs * D]`` pages giving ``[bs, heads, D]`` order."""
        cells = self.block_size * self.head_size
        per_token = self.key_gather.view(self.block_size, 1, self.head_size)
        return (torch.arange(heads).view(1, heads, 1) * cells + per_token).flatten()


@functools.cache
def probe(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> PageLayout:
    """Measure the C++ writer's page layout for this ISA, dtype and page shape (cached)."""
    from vllm import _custom_ops as ops

    cells = block_size * head_size
    index = torch.arange(cells).view(block_size, 1, head_size)  # [tokens, heads=1, D]
    found_k = torch.zeros(cells, dtype=torch.long)
    found_v = torch.zeros(cells, dtype=torch.long)
    digits = max(1, -(-(cells - 1).bit_length() // 4))
    for d in range(digits):
        place = _DIGIT_BASE ** d
        probe_kv = ((index // place) % _DIGIT_BASE + 1).to(dtype)
        page = torch.zeros(1, 1, 2 * block_size, head_size, dtype=dtype)
        key_cache, value_cache = page.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(probe_kv, probe_kv, key_cache, value_cache,
                                       torch.arange(block_size), isa)
        for found, region in ((found_k, key_cache), (found_v, value_cache)):
            got = region.reshape(-1).to(torch.long)
            if bool((got < 1).any()):
                raise RuntimeError(
                    f"minipic: vLLM's CPU KV writer (isa={isa}, dtype={dtype}, block "
                    f"{block_size}, head {head_size}) leaves page elements unwritten; the "
                    "position-free backend cannot read its keys back")
            found += (got - 1) * place
    return PageLayout(block_size, head_size, *_permutation(found_k, "key"),
                      *_permutation(found_v, "value"))


def _permutation(page_holds: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gather, scatter)`` from ``page_holds[p]`` = plain index stored at page position p."""
    cells = page_holds.numel()
    if not torch.equal(torch.sort(page_holds).values, torch.arange(cells)):
        raise RuntimeError(f"minipic: vLLM's CPU KV writer does not store {what}s as a "
                           "permutation of the page; the position-free backend cannot read "
                           "them back")
    gather = torch.empty(cells, dtype=torch.long)
    gather[page_holds] = torch.arange(cells)
    return gather, page_holds.clone()
