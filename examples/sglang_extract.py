"""Offline extraction with SGLang's own engine (sglang.Engine), in both modes.

    python examples/sglang_extract.py --out /tmp/hs-sglang-extract [--model DIR] [--samples 8]

`teacher` runs each conversation's tokens as given (one row per dataset token, with the data's
loss mask); `regenerate` lets the target model write the last assistant turn itself and captures
prompt and answer (loss mask on the answer). The same as:

    hscapture extract --engine sglang --mode teacher --out DIR/teacher --limit 8
    hscapture extract --engine sglang --mode regenerate --max-new-tokens 32 --out DIR/regenerate --limit 8
"""

import argparse
from pathlib import Path

from hscapture import open_store
from hscapture.extract import ExtractOptions, extract


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("/tmp/hs-sglang-extract"))
    parser.add_argument("--model", type=Path, help="HF model directory (default: the embedded tiny Llama)")
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()

    for mode in ("teacher", "regenerate"):
        out = args.out / mode
        options = ExtractOptions(
            out=out, model=args.model, engine="sglang", mode=mode, max_new_tokens=32, limit=args.samples, progress=False
        )
        summary = extract(options)
        store = open_store(out)
        key = store.keys()[0]
        record = store.record(key)
        print(
            f"{mode}: {summary.samples} samples, {summary.tokens} tokens in {summary.seconds:.0f} s; "
            f"{store.summary()['complete']} complete; {key}: {record['num_tokens']} tokens, "
            f"loss mask {record['loss_mask']}"
        )


if __name__ == "__main__":  # SGLang starts its processes with spawn, which re-imports this file
    main()
