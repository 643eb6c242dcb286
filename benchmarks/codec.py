"""Codec benchmark: msgspec typed Structs versus the plain ``msgpack`` package for ``Chunk``.

Why this exists: ``hscapture.protocol`` encodes its messages with msgspec's msgpack codec and
decodes them straight into typed, validated Structs. The obvious alternative is the plain
``msgpack`` package plus hand-written validation. This script measures both, side by side in
one run, on the per-step hot message (:class:`hscapture.protocol.Chunk`) so the choice rests
on a number rather than a claim.

Fairness: both sides end with the same validated ``protocol.Chunk`` object.

* msgspec: ``protocol.encode(chunk)`` and ``protocol.decode_to_consumer(data)`` (the typed
  decode checks every field's type, dispatches on the ``type`` tag and checks the version).
* msgpack: ``msgpack.packb(dict_with_same_fields)`` and ``msgpack.unpackb(data)`` followed by
  hand validation (the ``type`` tag, the version, each field's presence and exact type,
  the element types of the lists) and construction of the same ``protocol.Chunk``.

Two realistic chunks: a decode step (64 requests x 1 row) and a prefill chunk
(4 requests x 2048 rows); ``positions`` and ``token_ids`` are int64 bytes from
``protocol.pack_rows``. Each measurement is the median of ``--repeats`` timed repeats of
``--iterations`` calls (``time.perf_counter_ns``, garbage collector off while timing), after
``--warmup`` untimed repeats. The codecs are interleaved within each repeat so they see the
same machine state.

Run::

    python benchmarks/codec.py [--out benchmarks/results/codec-cpu.json]
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import numpy as np

from hscapture import protocol
from hscapture.errors import ProtocolError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "codec-cpu.json"

# Capture shape assumed for the chunk's byte counts: 4 captured tensors of a 4096-wide bf16 model.
NUM_TENSORS = 4
HIDDEN_SIZE = 4096
ROW_BYTES = NUM_TENSORS * HIDDEN_SIZE * 2
VOCAB_SIZE = 151_936

_MISSING = object()


# --------------------------------------------------------------------------------------------
# Test messages
# --------------------------------------------------------------------------------------------


def make_chunk(num_requests: int, rows_per_request: int, seed: int) -> protocol.Chunk:
    """A realistic ``Chunk``: vLLM-like request ids, increasing positions, random token ids."""
    rng = np.random.default_rng(seed)
    rows = num_requests * rows_per_request
    request_ids = [f"cmpl-{rng.bytes(16).hex()}-0" for _ in range(num_requests)]
    starts = rng.integers(0, 8192, size=num_requests)
    positions = np.concatenate([np.arange(s, s + rows_per_request) for s in starts])
    token_ids = rng.integers(0, VOCAB_SIZE, size=rows)
    slot = 5
    slot_bytes = 8192 * ROW_BYTES
    return protocol.Chunk(
        v=protocol.PROTOCOL_VERSION,
        seq=123_456,
        step=98_765,
        slot=slot,
        offset=slot * slot_bytes,
        nbytes=rows * ROW_BYTES,
        rows=rows,
        request_ids=request_ids,
        request_rows=[rows_per_request] * num_requests,
        positions=protocol.pack_rows(positions),
        token_ids=protocol.pack_rows(token_ids),
        dropped_rows=17,
        lost_rows=0,
    )


def chunk_to_dict(chunk: protocol.Chunk) -> dict[str, Any]:
    """The same fields, in the same order, as msgspec puts on the wire (tag first)."""
    return {
        "type": "chunk",
        "v": chunk.v,
        "seq": chunk.seq,
        "step": chunk.step,
        "slot": chunk.slot,
        "offset": chunk.offset,
        "nbytes": chunk.nbytes,
        "rows": chunk.rows,
        "request_ids": chunk.request_ids,
        "request_rows": chunk.request_rows,
        "positions": chunk.positions,
        "token_ids": chunk.token_ids,
        "dropped_rows": chunk.dropped_rows,
        "lost_rows": chunk.lost_rows,
    }


# --------------------------------------------------------------------------------------------
# The msgpack-package side: pack a dict, unpack and validate by hand
# --------------------------------------------------------------------------------------------


def msgpack_encode(fields: dict[str, Any]) -> bytes:
    return msgpack.packb(fields)


def _int(obj: dict[str, Any], name: str) -> int:
    value = obj.get(name, _MISSING)
    if type(value) is not int:  # exact type: msgspec rejects bool for an int field too
        if value is _MISSING:
            raise ProtocolError(f"Chunk: missing required field {name!r}")
        raise ProtocolError(f"Chunk.{name}: expected int, got {type(value).__name__}")
    return value


def _opt_int(obj: dict[str, Any], name: str) -> int:
    value = obj.get(name, 0)
    if type(value) is not int:
        raise ProtocolError(f"Chunk.{name}: expected int, got {type(value).__name__}")
    return value


def _bytes(obj: dict[str, Any], name: str) -> bytes:
    value = obj.get(name, _MISSING)
    if type(value) is not bytes:
        if value is _MISSING:
            raise ProtocolError(f"Chunk: missing required field {name!r}")
        raise ProtocolError(f"Chunk.{name}: expected bytes, got {type(value).__name__}")
    return value


def _list_of(obj: dict[str, Any], name: str, item_type: type) -> list[Any]:
    value = obj.get(name, _MISSING)
    if type(value) is not list:
        if value is _MISSING:
            raise ProtocolError(f"Chunk: missing required field {name!r}")
        raise ProtocolError(f"Chunk.{name}: expected array, got {type(value).__name__}")
    for i, item in enumerate(value):
        if type(item) is not item_type:
            raise ProtocolError(f"Chunk.{name}[{i}]: expected {item_type.__name__}, got {type(item).__name__}")
    return value


def msgpack_decode(data: bytes) -> protocol.Chunk:
    """``msgpack.unpackb`` plus the checks ``protocol.decode_to_consumer`` does for a Chunk."""
    try:
        obj = msgpack.unpackb(data)
    except Exception as exc:  # msgpack raises ValueError subclasses, TypeError, ...
        raise ProtocolError(f"malformed message ({len(data)} bytes): {exc}") from None
    if type(obj) is not dict:
        raise ProtocolError(f"malformed message: expected a map, got {type(obj).__name__}")
    kind = obj.get("type")
    if kind != "chunk":  # the real decoder would dispatch to the other ToConsumer types here
        raise ProtocolError(f"malformed message: unknown type tag {kind!r}")
    v = _int(obj, "v")
    if v != protocol.PROTOCOL_VERSION:
        raise ProtocolError(f"Chunk: protocol version {v}, this side speaks {protocol.PROTOCOL_VERSION}")
    return protocol.Chunk(
        v=v,
        seq=_int(obj, "seq"),
        step=_int(obj, "step"),
        slot=_int(obj, "slot"),
        offset=_int(obj, "offset"),
        nbytes=_int(obj, "nbytes"),
        rows=_int(obj, "rows"),
        request_ids=_list_of(obj, "request_ids", str),
        request_rows=_list_of(obj, "request_rows", int),
        positions=_bytes(obj, "positions"),
        token_ids=_bytes(obj, "token_ids"),
        dropped_rows=_opt_int(obj, "dropped_rows"),
        lost_rows=_opt_int(obj, "lost_rows"),
    )


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def time_loop(fn: Callable[[Any], object], arg: Any, iterations: int) -> int:
    """Total ns for ``iterations`` calls of ``fn(arg)``; the loop overhead is the same for all."""
    loop = itertools.repeat(None, iterations)
    start = time.perf_counter_ns()
    for _ in loop:
        fn(arg)
    return time.perf_counter_ns() - start


def check_equivalence(chunk: protocol.Chunk) -> dict[str, Any]:
    """Both paths must produce the same object, and each side must read the other's bytes."""
    spec_bytes = protocol.encode(chunk)
    pack_bytes = msgpack_encode(chunk_to_dict(chunk))
    assert protocol.decode_to_consumer(spec_bytes) == chunk
    assert msgpack_decode(pack_bytes) == chunk
    assert protocol.decode_to_consumer(pack_bytes) == chunk
    assert msgpack_decode(spec_bytes) == chunk
    for bad in (
        {**chunk_to_dict(chunk), "rows": True},
        {**chunk_to_dict(chunk), "request_rows": [1, "2"]},
        {k: val for k, val in chunk_to_dict(chunk).items() if k != "token_ids"},
    ):
        data = msgpack.packb(bad)
        for decode in (protocol.decode_to_consumer, msgpack_decode):
            try:
                decode(data)
            except ProtocolError:
                continue
            raise AssertionError(f"{decode.__name__} accepted an invalid Chunk")
    return {"wire_bytes_identical": spec_bytes == pack_bytes}


def run_case(name: str, chunk: protocol.Chunk, repeats: int, iterations: int, warmup: int) -> dict[str, Any]:
    fields = chunk_to_dict(chunk)
    spec_bytes = protocol.encode(chunk)
    pack_bytes = msgpack_encode(fields)
    packer = msgpack.Packer()
    # (codec, op) -> (callable, argument); interleaved in each repeat.
    ops: dict[tuple[str, str], tuple[Callable[[Any], object], Any]] = {
        ("msgspec", "encode"): (protocol.encode, chunk),
        ("msgspec", "decode"): (protocol.decode_to_consumer, spec_bytes),
        ("msgpack", "encode"): (msgpack_encode, fields),
        ("msgpack", "decode"): (msgpack_decode, pack_bytes),
        # Extras, to be generous to / honest about the msgpack side:
        ("msgpack", "encode_reused_packer"): (packer.pack, fields),
        ("msgpack", "encode_incl_dict_build"): (lambda c: msgpack.packb(chunk_to_dict(c)), chunk),
        ("msgpack", "decode_unvalidated"): (msgpack.unpackb, pack_bytes),
    }
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in ops}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(warmup + repeats):
            for key, (fn, arg) in ops.items():
                total = time_loop(fn, arg, iterations)
                if r >= warmup:
                    samples[key].append(total / iterations)
    finally:
        if gc_was_enabled:
            gc.enable()

    def med(codec: str, op: str) -> float:
        return statistics.median(samples[(codec, op)])

    result: dict[str, Any] = {
        "case": name,
        "requests": len(chunk.request_ids),
        "rows": chunk.rows,
        "msgspec": {
            "encode_ns": med("msgspec", "encode"),
            "decode_ns": med("msgspec", "decode"),
            "bytes": len(spec_bytes),
        },
        "msgpack": {
            "encode_ns": med("msgpack", "encode"),
            "decode_ns": med("msgpack", "decode"),
            "bytes": len(pack_bytes),
            "encode_reused_packer_ns": med("msgpack", "encode_reused_packer"),
            "encode_incl_dict_build_ns": med("msgpack", "encode_incl_dict_build"),
            "decode_unvalidated_ns": med("msgpack", "decode_unvalidated"),
        },
        "ratio_msgpack_over_msgspec": {
            "encode": med("msgpack", "encode") / med("msgspec", "encode"),
            "decode": med("msgpack", "decode") / med("msgspec", "decode"),
            "bytes": len(pack_bytes) / len(spec_bytes),
        },
        "samples_ns": {f"{codec}.{op}": values for (codec, op), values in samples.items()},
    }
    result.update(check_equivalence(chunk))
    return result


# --------------------------------------------------------------------------------------------
# Provenance and output
# --------------------------------------------------------------------------------------------


def git_info() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine_info() -> dict[str, Any]:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
    }


def markdown_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| case | codec | encode ns | decode ns (validated) | bytes |",
        "|---|---|---:|---:|---:|",
    ]
    for res in results:
        case = f"{res['case']} ({res['requests']} req, {res['rows']} rows)"
        for codec in ("msgspec", "msgpack"):
            m = res[codec]
            lines.append(f"| {case} | {codec} | {m['encode_ns']:,.0f} | {m['decode_ns']:,.0f} | {m['bytes']:,} |")
        ratio = res["ratio_msgpack_over_msgspec"]
        lines.append(
            f"| {case} | **msgpack / msgspec** | **{ratio['encode']:.2f}x** | **{ratio['decode']:.2f}x** "
            f"| {ratio['bytes']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats; the median is reported")
    parser.add_argument("--iterations", type=int, default=20_000, help="calls per repeat")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repeats before the timed ones")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.iterations < 1 or args.warmup < 0:
        parser.error("--repeats and --iterations must be >= 1, --warmup >= 0")

    cases = [
        ("decode step", make_chunk(num_requests=64, rows_per_request=1, seed=0)),
        ("prefill chunk", make_chunk(num_requests=4, rows_per_request=2048, seed=1)),
    ]
    results = [run_case(name, chunk, args.repeats, args.iterations, args.warmup) for name, chunk in cases]
    machine = machine_info()
    report = {
        "benchmark": "codec: msgspec typed msgpack vs msgpack package + hand validation, protocol.Chunk",
        "command": shlex.join(["python", *sys.argv] if argv is None else ["python", "benchmarks/codec.py", *argv]),
        "git": git_info(),
        "versions": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "msgspec": msgspec.__version__,
            "msgpack": importlib.metadata.version("msgpack"),
            "hscapture_protocol": protocol.PROTOCOL_VERSION,
        },
        "machine": machine,
        "method": {
            "repeats": args.repeats,
            "iterations": args.iterations,
            "warmup_repeats_excluded": args.warmup,
            "statistic": "median over repeats of (total perf_counter_ns / iterations)",
            "gc": "disabled while timing",
            "msgspec": "protocol.encode(chunk); protocol.decode_to_consumer(data) (typed decode, validation included)",
            "msgpack": "msgpack.packb(dict with the same fields); msgpack.unpackb(data) + hand validation "
            "(type tag, version, presence and exact type of each field and list element) -> protocol.Chunk",
            "chunk_shape": f"row bytes {ROW_BYTES} ({NUM_TENSORS} tensors x {HIDDEN_SIZE} bf16); "
            "positions/token_ids are int64 bytes via protocol.pack_rows",
        },
        "note": (
            f"CPU-only timings from a {machine['cpu_count']}-core host; read the msgpack/msgspec ratios, "
            "not the absolute ns, which depend on the host. Single-threaded, no GPU involved."
        ),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown_table(results))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
