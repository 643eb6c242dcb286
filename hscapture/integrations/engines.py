"""What the vLLM and SGLang integrations share: the plugin's settings and its capture object's start and failure, and
the architecture tables that say what an engine's EAGLE-3 aux capture keeps.

Both engines capture through their aux hidden states, from a plugin loaded in the engine's own processes, so what
does not depend on the engine is written once, here. Errors still name the engine they are about (``engine``:
``vLLM``, ``SGLang``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from hscapture.config import (
    CaptureConfig,
    default_ring_bytes,
    default_slot_bytes,
    dtype_name,
    eagle3_default_layers,
    num_layers_of,
    read_model_config,
    resolve_layers,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


# -- architecture tables ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineArchitecture:
    """One row of an engine's architecture table: how one of its model classes captures aux layers."""

    #: The HF ``architectures[0]`` of config.json: the class the engine builds.
    name: str
    #: ``module.Class`` (under the engine's models package) of the decoder stack that holds the layers to capture.
    stack: str
    #: Lowest layer id the engine can capture.
    first_layer: int
    #: ``cpu-test`` (run on the engine's CPU path by its tests) or ``source`` (read from the engine's source only).
    checked: str

    #: The description of the final state (the LM head's input), in the engine's words.
    FINAL_STATE: ClassVar[str]

    @classmethod
    def rows(cls: type[Arch], names: Sequence[str], **fields: Any) -> dict[str, Arch]:
        """Table rows of the architectures ``names``, alike but for their name."""
        return {name: cls(name=name, **fields) for name in names}

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """The first and last hscapture layer ids this architecture can capture (here: up to ``L``)."""
        return self.first_layer, num_layers

    def descriptions(self, layers: Sequence[int], capture_last: bool, num_layers: int | None = None) -> list[str]:
        """One sentence per stored tensor saying exactly what the engine captured: ``layers`` in order (of a model
        of ``num_layers`` decoder layers, where the sentence depends on it), then the final state."""
        out = [self.layer_description(k, num_layers) for k in layers]
        if capture_last:
            out.append(self.FINAL_STATE)
        return out

    def layer_description(self, k: int, num_layers: int | None) -> str:
        """What the engine's capture of hscapture layer ``k`` holds, in one sentence (each engine's own)."""
        raise NotImplementedError(f"{type(self).__name__} does not describe its layers")

    @staticmethod
    def residual_stream(k: int, engine_name: str) -> str:
        """The description of the residual stream entering decoder layer ``k``, which the engine calls
        ``engine_name`` (``vLLM LlamaForCausalLM aux layer 2``)."""
        return (
            f"residual stream entering decoder layer {k} (hidden + residual before its input norm); "
            f"{engine_name}, HF output_hidden_states[{k}]"
        )


Arch = TypeVar("Arch", bound=EngineArchitecture)


def table_row(table: Mapping[str, Arch], name: str, engine: str) -> Arch:
    """The row of ``engine``'s model class ``name``.

    Raises:
        ValueError: a class not in the table, naming the ones it holds.
    """
    try:
        return table[name]
    except KeyError:
        raise ValueError(
            f"{engine} architecture {name!r}: hscapture does not know which tensor {engine}'s aux capture keeps for "
            f"it, so it cannot describe what it would store; supported: {', '.join(sorted(table))} "
            f"(hscapture/integrations/{engine.lower()}_models.py lists what each one captures)"
        ) from None


def model_architecture(model: Path | str, table: Mapping[str, Arch], engine: str) -> tuple[Arch, int]:
    """A model's table row and decoder layers ``L``, from its config.json, before the engine starts; warns where the
    row was read from the engine's source only.

    Raises:
        ValueError: no config.json, no architectures entry in it, an architecture not in ``table``.
    """
    config = read_model_config(model)
    names = config.get("architectures") or []
    if not names:
        raise ValueError(f"{model}: config.json has no architectures entry; {engine} needs one to pick its model")
    arch = table_row(table, names[0], engine)
    if arch.checked == "source":
        log.warning(
            "what %s captures for %s was read from its source; hscapture's tests have not run this architecture",
            engine,
            arch.name,
        )
    return arch, num_layers_of(config)


def capture_layers(
    arch: EngineArchitecture, num_layers: int, layers: str | Sequence[int] | None, engine: str
) -> tuple[int, ...]:
    """hscapture layer ids to capture, ascending and distinct: ``layers`` resolved
    (:func:`~hscapture.config.resolve_layers`), or EAGLE-3's default ``[2, L//2, L-3]`` without repeats.

    Raises:
        ValueError: a layer ``arch`` cannot capture, a repeated one, or none.
    """
    if layers is None:
        return eagle3_default_layers(num_layers)
    chosen = tuple(sorted(resolve_layers(layers, num_layers, arch.layer_range(num_layers), f"{engine}'s {arch.name}")))
    if not chosen:
        raise ValueError(f"--layers: {engine}'s aux capture needs at least one layer id (it always captures some)")
    return chosen


def loaded_architecture(model: Any, table: Mapping[str, Arch], engine: str) -> Arch:
    """The table row of a model the engine loaded.

    Raises:
        RuntimeError: its class is not in ``table`` (the engine must not start serving).
    """
    try:
        return table_row(table, type(model).__name__, engine)
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None


def check_stack(arch: EngineArchitecture, stack: Any, package: str, engine: str, holder: str) -> None:
    """The loaded decoder stack must be the class ``arch`` was read from.

    Args:
        package: the engine's models package, left off the stack's module name (``sglang.srt.models.``).
        holder: what the stack holds, for the message (``aux layers``, ``capture list``).

    Raises:
        RuntimeError: another class: the engine's version differs from the one the table was read from.
    """
    stack_name = f"{type(stack).__module__.removeprefix(package)}.{type(stack).__qualname__}"
    if stack_name != arch.stack:
        raise RuntimeError(
            f"{engine}'s {arch.name} keeps its {holder} in {stack_name}, not {arch.stack} whose capture hscapture "
            f"has checked; this {engine} version differs from the one hscapture's table was read from"
        )


# -- the plugin ------------------------------------------------------------------------------------------------------
Settings = TypeVar("Settings", bound="EngineSettings")


@dataclass
class EngineSettings:
    """What an engine's plugin needs to know, passed to the engine's processes as JSON in :attr:`ENV`."""

    #: The environment variable each engine's settings travel in; unset there = its plugin is inert.
    ENV: ClassVar[str] = ""

    #: Base ZeroMQ endpoint; with data parallelism each stream appends ``-dp<rank>`` (:func:`endpoint_for`).
    endpoint: str
    #: Also capture the post-norm final state (the LM head's input) beside the aux layers.
    capture_last: bool = True
    #: ``drop`` (serving never waits) or ``block`` (nothing lost: offline extraction).
    policy: str = "drop"
    #: Bytes of one ring slot; None: room for :data:`~hscapture.config.SLOT_ROWS` rows, and at least 4 MiB.
    slot_bytes: int | None = None
    #: Ring bytes; None: two of the engine's largest steps, and at least :data:`~hscapture.config.RING_SLOTS` slots.
    ring_bytes: int | None = None
    block_timeout_s: float = 120.0
    #: Facts stored with the run (model path, launcher, ...).
    meta: dict[str, Any] = field(default_factory=dict)
    #: The share of requests captured, chosen by a hash of the request's store key
    #: (:func:`~hscapture.selection.sampled`); None: every request. The others leave no rows and no record, and get a
    #: prefix-cache namespace of their own: a captured request never takes a prefix whose rows were never stored.
    sample_rate: float | None = None

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls: type[Settings], raw: str) -> Settings:
        try:
            return cls(**json.loads(raw))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{cls.ENV}: not valid capture settings ({exc}); it must be PluginSettings JSON") from exc


# -- the server launch (``hscapture serve``) --------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeCapture:
    """What ``hscapture serve`` asks of an engine's server, whatever the engine (its options of the same names)."""

    #: Base ZeroMQ endpoint of the capture streams.
    endpoint: str
    #: Layer ids and ranges as given (None: the engine's EAGLE-3 default).
    layers: str | tuple[int, ...] | None
    capture_last: bool
    policy: str
    slot_bytes: int | None
    #: Facts stored with the run (launcher, the engine's arguments, ...).
    meta: dict[str, Any]
    #: SGLang on a GPU: decode rows copied from inside its CUDA graphs.
    graph_copy: bool = True
    #: The share of requests captured (None: every one).
    sample_rate: float | None = None
    #: Ring bytes, a whole number of ``slot_bytes`` slots (None: the plugin's default).
    ring_bytes: int | None = None


@dataclass(frozen=True)
class ServerLaunch:
    """An engine's HTTP server with the plugin capturing: what ``hscapture serve`` starts, planned (and refused) before
    anything starts."""

    #: The engine's name in messages (``SGLang``, ``vLLM``).
    name: str
    command: list[str]
    #: Variables set on top of ``serve``'s environment: the plugin's settings and what the engine needs for capture.
    env: dict[str, str]
    #: Capture streams the server publishes, one consumer each (``DIR/dp<rank>`` when more than one).
    streams: int
    #: What the engine does with the requests it serves when told to stop (SIGTERM), for ``serve``'s message.
    on_stop: str


def option_value(args: Sequence[str], *names: str) -> str | None:
    """The value of an ``--name value`` or ``--name=value`` option in a command line (the last one given)."""
    found = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                found = args[i + 1]
            elif arg.startswith(name + "="):
                found = arg.split("=", 1)[1]
    return found


def endpoint_for(base: str, dp_rank: int, dp_size: int) -> str:
    """One stream per data-parallel rank (SGLang: per attention-DP group); plain TP has a single one."""
    return base if dp_size <= 1 else f"{base}-dp{dp_rank}"


@dataclass(frozen=True)
class LoadedModel:
    """What a plugin found at model load, for the capture config and the run's meta."""

    #: The engine's version and the model it loaded (path or hub name).
    version: str
    model: str
    hidden_size: int
    num_layers: int
    dtype: torch.dtype
    #: Most rows one forward of the engine holds.
    max_rows: int
    dp_rank: int
    dp_size: int
    #: Where the engine's states are: ``cpu`` or ``cuda:<index>``.
    device: str


class EngineCapture:
    """What each engine's capture object (one per engine process) shares: its settings, the producer it starts once
    the model is loaded, and how a failure ends that producer's run while serving goes on."""

    #: The engine in the run's meta (``vllm``, ``sglang``).
    engine: ClassVar[str]
    #: Meta key of the engine's own ids of the captured layers.
    layers_key: ClassVar[str]
    #: The integration's logger: capture failures are logged under its name.
    logger: ClassVar[logging.Logger]

    def __init_subclass__(cls, engine: str = "", layers_key: str = "", logger: logging.Logger | None = None) -> None:
        """``class VLLMCapture(EngineCapture, engine="vllm", layers_key="vllm_aux_layers", logger=log)``; a subclass
        of an engine's class keeps its engine's."""
        super().__init_subclass__()
        if engine:
            cls.engine, cls.layers_key, cls.logger = engine, layers_key, logger or log

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.producer: Any = None
        self.enabled = True
        #: Set at model load: the layers the engine's aux output holds, in order.
        self.layers: tuple[int, ...] = ()

    def _open(
        self, arch: str, descriptions: list[str], loaded: LoadedModel, meta: Mapping[str, Any] | None = None
    ) -> CaptureConfig:
        """Start the producer for :attr:`layers` of ``loaded``; ``descriptions``: one per stored tensor; ``meta``: the
        engine's own facts for the run's meta."""
        from hscapture.producer import Producer

        settings = self.settings
        row_bytes = (len(self.layers) + settings.capture_last) * loaded.hidden_size * loaded.dtype.itemsize
        slot_bytes = settings.slot_bytes or default_slot_bytes(row_bytes)
        config = CaptureConfig(
            layers=self.layers,
            hidden_size=loaded.hidden_size,
            num_layers=loaded.num_layers,
            capture_last=settings.capture_last,
            dtype=dtype_name(loaded.dtype),
            slot_bytes=slot_bytes,
            ring_bytes=settings.ring_bytes or default_ring_bytes(slot_bytes, row_bytes, loaded.max_rows),
            max_step_rows=loaded.max_rows,
            policy=settings.policy,  # type: ignore[arg-type]
            endpoint=endpoint_for(settings.endpoint, loaded.dp_rank, loaded.dp_size),
            device=loaded.device,
            block_timeout_s=settings.block_timeout_s,
        )
        run_meta = {
            "engine": self.engine,
            f"{self.engine}_version": loaded.version,
            "model": loaded.model,
            "architecture": arch,
            self.layers_key: list(self.layers),
            "dp_rank": loaded.dp_rank,
            "dp_size": loaded.dp_size,
            **(meta or {}),
            **settings.meta,
        }
        self.producer = Producer(config, tensor_descriptions=descriptions, meta=run_meta)
        return config

    def _fail(self, exc: BaseException) -> None:
        """Capture failed while serving: log the cause, end the producer's run with it, serve on."""
        cause = f"{type(exc).__name__}: {exc}"
        self.logger.error("hscapture: capture failed, serving goes on without it: %s", cause, exc_info=exc)
        self._shut("capture failed", error=cause)

    def _shut(self, why: str, error: str = "") -> None:
        self.enabled = False
        producer, self.producer = self.producer, None
        if producer is not None:
            try:
                producer.close(error=error)
            except Exception:
                self.logger.exception("hscapture: closing the producer (%s) failed", why)
