"""A probe (session 29): sm120_mla for decode and verify beside another prefill backend, NGRAM, 4 layers.

Ran on the H200 as `python3 prefill_backend_probe.py --prefill-attention-backend flashinfer
--speculative-attention-mode decode` (the arguments go to the server as they are); it prints, and
prefill_backend_probe.jsonl holds what it printed. `decode_bench --prefill-backend` does the same
since this run."""
import os
import sys
import tempfile
import time
from pathlib import Path

from sm120_workbook.decode_bench import context_length_for, measure_decode, random_input_ids
from sm120_workbook.dummy_models import materialize_model
from sm120_workbook.service import ServerConfig, SGLangServer

out = Path(os.environ["OUT"])
extra = tuple(sys.argv[1:])
with tempfile.TemporaryDirectory() as tmp:
    model = materialize_model("k2_tp8_slice", 4, dest=Path(tmp) / "model")
    vocab = 163840
    import json
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    cfg = ServerConfig(model_path=model, attention_backend="sm120_mla", tp=1, spec="ngram", num_draft_tokens=8,
                       context_length=context_length_for([65536], 256, 8), extra_args=extra)
    t0 = time.monotonic()
    with SGLangServer(cfg, log_path=out / "server.log", startup_timeout_s=330, progress=False) as srv:
        print(f"up in {srv.startup_s:.0f} s; server_info backends:",
              {k: v for k, v in (srv.server_info or {}).items() if "attention" in k}, flush=True)
        srv.generate(random_input_ids(512, vocab, 7), 16)
        for ctx, seed in ((4096, 1), (4096, 2), (65536, 3), (65536, 4)):
            r = measure_decode(srv, ctx, 256, vocab, seed)
            print(f"ctx {ctx}: tok/s {r['tok_s']:.0f} accept {r['accept_len']:.2f} step {r['verify_step_ms']:.2f} ms "
                  f"ttft {r['ttft_s']:.2f} s", flush=True)
