"""Run ``sglang.Engine`` once over given prompts and dump what SGLang itself returned, as JSON.

A separate process per engine (SGLang keeps process-wide state, and ``Engine.shutdown`` kills
every child of the process that made it). With ``--capture ENDPOINT`` the hscapture plugin is
switched on (block policy) and closed through ``collective_rpc`` before shutdown.

    python -m tests.sglang_driver --model DIR --prompts prompts.json --out result.json [--capture EP]

``--absorbed-mla`` (DeepSeek family, diagnosis only) makes SGLang's torch_native backend prefill by
absorbed MLA, the path SGLang itself takes whenever a request has a cached prefix; without it a
fresh prefill takes the MHA path, which torch_native gets wrong (see :func:`absorbed_mla_hook`).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

from hscapture.integrations.sglang import (
    CLOSE_RPC,
    CPU_ENGINE_KWARGS,
    CPU_POOL_TOKENS,
    ENV,
    PluginSettings,
    engine_kwargs,
    use_cpu_host_env,
)
from hscapture.integrations.sglang_models import launch_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--out", required=True)
    parser.add_argument("--capture", help="switch capture on, publishing to this endpoint")
    parser.add_argument("--aux", action="store_true", help="SGLang's aux-state flags (implied by --capture)")
    parser.add_argument("--then", help="JSON list of token-id lists generated once the first ones finished")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--chunked-prefill-size", type=int, default=32)
    parser.add_argument("--absorbed-mla", action="store_true", help="DeepSeek: prefill by absorbed MLA too")
    parser.add_argument("--engine-json", default="{}", help="more sglang.Engine keyword arguments, as JSON")
    parser.add_argument(
        "--layers", help="hscapture layer ids, e.g. 1,3,6, or 'auto' for hscapture's default (default: SGLang's)"
    )
    parser.add_argument("--settings-json", default="{}", help="more PluginSettings fields, as JSON")
    args = parser.parse_args()
    use_cpu_host_env()
    layer_ids = None
    if args.layers:
        plan = launch_plan(args.model, None if args.layers == "auto" else [int(k) for k in args.layers.split(",")])
        layer_ids = plan.sglang_ids
    if args.capture:
        settings = {"slot_bytes": 1 << 20, **json.loads(args.settings_json)}
        if args.layers:
            settings["layers"] = list(plan.layers)
        os.environ[ENV] = PluginSettings(endpoint=args.capture, policy="block", **settings).to_env()
    import sglang

    engine = sglang.Engine(
        model_path=args.model,
        log_level="error",
        mem_fraction_static=0.3,
        chunked_prefill_size=args.chunked_prefill_size,
        **CPU_ENGINE_KWARGS,
        **({"forward_hooks": [ABSORBED_MLA_HOOK]} if args.absorbed_mla else {}),
        **{"disable_radix_cache": True, "max_total_tokens": CPU_POOL_TOKENS, **json.loads(args.engine_json)},
        # Without the aux flags SGLang returns the post-norm last layer, once asked to return states at all.
        **(engine_kwargs(layer_ids) if args.capture or args.aux else {"enable_return_hidden_states": True}),
    )
    rounds = []
    for path in (args.prompts, args.then):
        if path:
            with open(path) as f:
                rounds.append(json.load(f))
    prompts = [p for batch in rounds for p in batch]
    try:
        outputs = []
        for batch in rounds:  # one after the other: a later round finds the earlier one in the radix cache
            outputs += engine.generate(
                input_ids=batch,
                sampling_params={"max_new_tokens": args.max_new_tokens, "temperature": 0.0},
                return_hidden_states=True,
            )
        if args.capture:
            engine.collective_rpc(CLOSE_RPC)
    finally:
        engine.shutdown()
    result = [
        {
            "rid": o["meta_info"]["id"],
            "prompt": p,
            "output_ids": o["output_ids"],
            "hidden_states": returned_rows(o["meta_info"]),
        }
        for p, o in zip(prompts, outputs)
    ]
    with open(args.out, "w") as f:
        json.dump(result, f)


#: SGLang ``forward_hooks`` entry whose factory runs in the scheduler process before the first real forward.
ABSORBED_MLA_HOOK = {
    "name": "absorbed-mla",
    "target_modules": ["model"],
    "hook_factory": "tests.sglang_driver:absorbed_mla_hook",
}


def absorbed_mla_hook(config: dict) -> Callable[..., None]:
    """Give torch_native SGLang's absorbed-MLA dispatch for every DeepSeek attention, and return a no-op hook.

    SGLang (0.5.23) has no DeepSeek attention handler for torch_native, so it uses triton's
    (``models/deepseek_common/attention_backend_handler.py``: ``get_handler`` falls back to
    ``handle_attention_triton``), which sends a prefill without cached prefix down the MHA path.
    That path stores the MLA latent in the KV pool and calls ``attn_mha(q, k, v,
    save_kv_cache=False)`` (``attention_forward_methods/forward_mha.py:forward_normal_core``),
    expecting the backend to attend over the k and v it is given; torch_native's
    ``forward_extend`` (``layers/attention/torch_native_backend.py``) ignores them and attends
    over the pool: keys ``[kv_a_layernorm(c_kv), rope(k_pe)]``, values ``kv_a_layernorm(c_kv)``.
    The absorbed path (``forward_absorb_*``, ``attn_mqa``) reads that pool as intended.
    """
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )

    AttentionBackendRegistry.register("torch_native", _dispatch_mla_subtype)
    return lambda module, inputs, output: None


def returned_rows(meta_info: dict) -> list[list[float]]:
    """The rows of states SGLang returned for a request (``return_hidden_states``), in position order.

    SGLang returns one list of rows per prefill forward, then one row per decode step.
    """
    return [
        row for part in meta_info["hidden_states"] for row in (part if part and isinstance(part[0], list) else [part])
    ]


if __name__ == "__main__":
    main()
