"""A test-only stand-in for ``sgl_kernel``, SGLang's compiled kernels, on a CPU without them.

PyPI's ``sgl-kernel`` is built for CUDA only (importing it needs ``libcuda.so.1``), yet SGLang's
CPU engine imports two of its ops unconditionally. On a CPU without AMX every other op falls
back to torch, so one op is implemented here in plain torch, after SGLang's own Triton kernel
of it (``sglang/srt/mem_cache/allocation.py``, ``assign_req_to_token_pool``), and every other
name raises: the tests run real SGLang with this one kernel op substituted. The server finds
this package first on its PYTHONPATH (tests/realsw/sglanglib.py).
"""

from __future__ import annotations

from typing import Any

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request i of the batch, the KV slots it was given (``out_cache_loc``, the
    batch's new slots one request after another) into its row of the token pool, at its
    positions ``start_offset[i]:end_offset[i]``."""
    del pool_len  # the row length; a torch row knows it
    starts, ends = start_offset.tolist(), end_offset.tolist()
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), starts, ends):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[taken : taken + n].to(req_to_token.dtype)
        taken += n


def _not_here(name: str) -> Any:
    def op(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"sgl_kernel.{name} is not in the tests' CPU stand-in")

    op.__name__ = name
    return op


# Imported by the CPU engine at start-up, called only by what the tests do not use: moving KV
# entries between slots (the hierarchical cache) and speculative decoding.
_UNUSED = (
    "copy_all_layer_kv_cache_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "rotate_input_ids_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
)
globals().update({name: _not_here(name) for name in _UNUSED})


def __getattr__(name: str) -> Any:
    # Raised as AttributeError so `from sgl_kernel import x` is an ImportError, which
    # SGLang's optional imports already handle; an op called for real fails loudly.
    raise AttributeError(f"sgl_kernel.{name} is not in the tests' CPU stand-in")
