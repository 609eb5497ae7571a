"""`--warmups sm120_long_prompt`: take a server's first-long-prompt builds out of users' requests.

On a fresh machine a server's first prompt longer than one prefill chunk waits on the host while
kernels are built: 32.6 s on the H200 (session 33, by the files each build wrote: SGLang's
`set_mla_kv_buffer` through tvm-ffi, 11 s, FlashInfer's batch MLA module, 21 s, and a Triton
kernel; session 31's scheduler stacks showed the same,
data/results/probes/first_request_stacks.jsonl). They run where a chunk extends a prefix already
in the KV pool, which short prompts (and SGLang's own start-up request) never reach.

This registers a warm-up with SGLang's own registry (`sglang.srt.entrypoints.warmup.warmup`), so
`--warmups sm120_long_prompt` runs it in the launcher before the server listens:
- a prompt of one chunk and a bit (`--chunked-prefill-size` + 256 tokens), so its second
  chunk extends the first;
- the same prompt plus 64 tokens, which extends it from the radix cache (the path a server with
  chunked prefill off takes).
Each asks for a few decode tokens, so the speculative verify runs as well. The prompts are random
token ids, as `--skip-tokenizer-init` servers take them. A prompt the server rejects fails the
start-up with SGLang's message (SGLang raises for aborts with a status code; an abort without one
is raised here): a server that cannot prefill a long prompt should say so before it listens.

What it cost on the H200 (16 layers): 113-135 s on a fresh machine (sessions 32-33), where it
runs before SGLang's own start-up request and so also builds FlashInfer's ragged prefill module
(88 s in that request without the warm-up); 4-5 s on a machine where a server had run, most of it
Triton rebuilding kernels that the first server had put in torch inductor's Triton cache folder;
0.5 s with every cache filled (session 33).
"""
from __future__ import annotations

import logging
import time

WARMUP_NAME = "sm120_long_prompt"
PAST_ONE_CHUNK = 256        # tokens past the chunk size: the second chunk extends the first
EXTENSION = 64              # tokens the second prompt adds to the first (a radix-cache prefix)
DECODE_TOKENS = 8           # a few decode (and verify) steps after each prompt
NO_CHUNK_PROMPT = 4096      # the first prompt's length when chunked prefill is off
LOWEST_TOKEN_ID = 100       # random ids above the special tokens of common vocabularies

logger = logging.getLogger(__name__)


def prompt_lengths(chunked_prefill_size: int | None, context_len: int,
                   max_req_input_len: int | None = None, reserved_tokens: int = 0) -> tuple[int, int]:
    """The two prompts' lengths: one chunk and PAST_ONE_CHUNK tokens, then EXTENSION more.

    Both are cut to what a request may hold: the context length less the reserved and decode
    tokens, and the scheduler's max_req_input_len. Raises ValueError (naming the argument)
    where not even a 2-token prompt fits.
    """
    if not isinstance(context_len, int) or isinstance(context_len, bool) or context_len < 1:
        raise ValueError(f"context_len: must be a positive int, got {context_len!r}")
    chunked = chunked_prefill_size is not None and chunked_prefill_size > 0
    first = chunked_prefill_size + PAST_ONE_CHUNK if chunked else NO_CHUNK_PROMPT
    # SGLang refuses input + reserved >= context_len and input + reserved + new > context_len
    # (TokenizerManager._validate_one_request), and input >= max_req_input_len (the
    # scheduler's validate_input_length).
    limit = context_len - reserved_tokens - DECODE_TOKENS - 1
    if max_req_input_len is not None:
        limit = min(limit, max_req_input_len - 1)
    if limit < 2:
        raise ValueError(f"context_len: {context_len} tokens leave no room for a warm-up prompt "
                         f"({reserved_tokens} reserved, {DECODE_TOKENS} decode)")
    second = min(first + EXTENSION, limit)
    return min(first, second - 1), second


async def long_prompt_warmup(disaggregation_mode: str, tokenizer_manager) -> None:
    """SGLang's warm-up signature: (disaggregation_mode, tokenizer_manager)."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
    from sglang.srt.managers.io_struct import GenerateReqInput

    from ..decode_bench import random_input_ids

    chunk = tokenizer_manager.server_args.chunked_prefill_size
    first, second = prompt_lengths(chunk, tokenizer_manager.context_len,
                                   tokenizer_manager.max_req_input_len,
                                   tokenizer_manager.num_reserved_tokens)
    if not (chunk is not None and 0 < chunk < first):   # no chunk of the first prompt has a prefix
        logger.warning("%s: a %d-token prompt fits one chunk (chunked prefill size %s, context "
                       "%d); only the radix-cache extension warms the prefix path", WARMUP_NAME,
                       first, chunk, tokenizer_manager.context_len)
    ids = random_input_ids(second, tokenizer_manager.model_config.vocab_size, seed=0, low=LOWEST_TOKEN_ID)
    for n in (first, second):
        req = GenerateReqInput(input_ids=ids[:n], sampling_params={
            "max_new_tokens": DECODE_TOKENS, "temperature": 0.0, "ignore_eos": True})
        if disaggregation_mode != "null":   # as SGLang's own warm-ups do on PD servers
            req.bootstrap_room = 0
            req.bootstrap_host = FAKE_BOOTSTRAP_HOST
        t0 = time.perf_counter()
        out = None
        async for out in tokenizer_manager.generate_request(req, None):
            pass
        reason = ((out or {}).get("meta_info") or {}).get("finish_reason") or {}
        if reason.get("type") == "abort":
            raise RuntimeError(f"{WARMUP_NAME}: the server aborted the {n}-token warm-up prompt: "
                               f"{reason.get('message', reason)}")
        logger.info("%s: a %d-token prompt and %d decode tokens took %.1f s", WARMUP_NAME, n,
                    DECODE_TOKENS, time.perf_counter() - t0)


def register_warmup() -> bool:
    """Add `sm120_long_prompt` to SGLang's warm-up registry (idempotent); True if added."""
    from sglang.srt.entrypoints import warmup as sglang_warmup

    if sglang_warmup._warmup_registry.get(WARMUP_NAME) is long_prompt_warmup:
        return False
    sglang_warmup.warmup(WARMUP_NAME)(long_prompt_warmup)
    return True


def unregister_warmup() -> None:
    """Take the name out of SGLang's registry again (for tests)."""
    from sglang.srt.entrypoints import warmup as sglang_warmup

    if sglang_warmup._warmup_registry.get(WARMUP_NAME) is long_prompt_warmup:
        del sglang_warmup._warmup_registry[WARMUP_NAME]
