"""The row copier: a step's rows into a ring slot's planes, by the cheapest way there is for them.

Plane ``t`` of a slot holds captured tensor ``t``'s rows. Three ways in, tried in order:

1. the copy inside the graph replay just launched (:class:`~hscapture.producer.row_kernel.GraphRows`):
   the host only writes where the rows go, no launch;
2. one driver launch of the row kernel (:class:`~hscapture.producer.row_kernel.RowKernel`, a GPU ring);
3. torch: ``torch.stack`` of separate tensors, ``torch.cat`` of side-by-side ones, ``index_select`` per
   tensor with a ``row_index`` (a host ring, or sources the kernel does not take). Same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hscapture.producer.row_kernel import GraphRows, RowKernel

#: Slot views kept for reuse (per slot, row count and grouping of the states); cleared when full.
_MAX_VIEWS = 1024

#: Where a step of side-by-side states goes in one launch: the slot's planes seen row by row
#: (``[count, num_tensors, hidden]``, strided), and the ``[count, k, hidden]`` shape of each state's rows.
_Targets = tuple[torch.Tensor, "tuple[tuple[int, int, int], ...]"]


class RowCopier:
    """Copies rows into the slots of one ring.

    Args:
        slots: typed flat views of every slot, in order (one allocation).
        slot_bytes, hidden, num_tensors: the ring's layout.
        stream: the ring's :meth:`~hscapture.ring.base.Ring.stream_reader` (launches go on the current stream).
        graph_wait_s: how long a graph replay's copy waits for its plan entry before it gives up.
    """

    def __init__(
        self,
        slots: list[torch.Tensor],
        slot_bytes: int,
        hidden: int,
        num_tensors: int,
        stream: Callable[[], int],
        graph_wait_s: float,
    ) -> None:
        self._slots, self._slot_bytes, self._hidden, self._num_tensors = slots, slot_bytes, hidden, num_tensors
        self._graph_wait_s = graph_wait_s
        self._kernel = RowKernel.load(slots, slot_bytes, hidden, num_tensors, stream)
        #: The copy inside the engine's graphs, once asked for (:meth:`graph_rows`).
        self.graph: GraphRows | None = None
        self._views: dict[tuple[int, int, tuple[int, ...]], tuple[torch.Tensor, _Targets | None]] = {}
        #: ``[count, k, hidden]`` of each state's rows, per row count and grouping (writes into a slot's rows).
        self._shapes: dict[tuple[int, tuple[int, ...]], tuple[tuple[int, int, int], ...]] = {}

    def graph_rows(self) -> GraphRows | None:
        """The copy for the engine's CUDA graphs (made on first call); None on a host ring or where its kernels do
        not compile."""
        if self.graph is None and self._slots:
            self.graph = GraphRows.load(
                self._slots, self._slot_bytes, self._hidden, self._num_tensors, self._graph_wait_s
            )
        return self.graph

    def write(
        self,
        slot: int,
        states: Sequence[torch.Tensor],
        spans: tuple[int, ...],
        row_index: torch.Tensor | None,
        begin: int,
        count: int,
        first: int = 0,
        row_stride: int = 0,
    ) -> bool:
        """Copy rows ``[begin, begin + count)`` of the step into ``slot``: planes of ``count`` rows, or (a whole
        step, ``row_stride``) rows ``[first, first + count)`` of planes of ``row_stride`` rows.

        Args:
            spans: how many captured tensors each state holds side by side.
            row_index: indices of the kept rows among the states' rows (None: all, in order).

        Returns:
            True when the copy inside the graph replay just launched writes them.
        """
        graph = self.graph
        if (
            graph is not None
            and graph.pending
            and row_index is None
            and graph.write(slot, states, spans, begin, count, first, row_stride or count)
        ):
            return True
        kernel = self._kernel
        if (
            kernel is not None
            and row_index is None
            and kernel.write(slot, states, spans, begin, count, first, row_stride or count)
        ):
            return False
        if row_stride:  # the slot's views are made once; a step takes rows of them (one slice)
            planes, targets = self._targets(slot, row_stride, spans)
            if targets is None:
                torch.stack(states, out=planes[:, first : first + count])  # type: ignore[arg-type]
                return False
            shapes = self._shapes.get((count, spans))
            if shapes is None:
                shapes = self._shapes[count, spans] = tuple((count, k, self._hidden) for k in spans)
            by_row = targets[0][first : first + count]
            torch.cat([state.reshape(shape) for state, shape in zip(states, shapes)], dim=1, out=by_row)
            return False
        planes, targets = self._targets(slot, count, spans)
        if row_index is not None:
            index, hidden, t = row_index[begin : begin + count], self._hidden, 0
            for state, k in zip(states, spans):
                for j in range(k):
                    torch.index_select(state[:, j * hidden : (j + 1) * hidden], 0, index, out=planes[t])
                    t += 1
            return False
        whole = begin == 0 and count == states[0].shape[0]  # the usual step: no slicing
        parts = states if whole else [state[begin : begin + count] for state in states]
        if targets is None:  # separate tensors: one launch for all, not one copy each
            torch.stack(parts, out=planes)  # type: ignore[arg-type]
            return False
        # Side-by-side states: one launch for all too, each state's rows as [count, k, hidden] planes.
        by_row, shapes = targets
        torch.cat([part.reshape(shape) for part, shape in zip(parts, shapes)], dim=1, out=by_row)
        return False

    def close(self) -> None:
        """The ring is about to be freed: no copy writes into it from now on (the engine's graphs replay on)."""
        self._slots, self._kernel = [], None
        self._views.clear()
        if self.graph is not None:
            self.graph.off()

    def _targets(self, slot: int, count: int, spans: tuple[int, ...]) -> tuple[torch.Tensor, _Targets | None]:
        """Views of ``slot`` for ``count`` rows, made once per shape: every tensor's plane
        ``[num_tensors, count, hidden]``, and (when some state holds several tensors) the planes seen row
        by row with the ``[count, k, hidden]`` shape of each state's rows (:data:`_Targets`)."""
        key = (slot, count, spans)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            hidden, num = self._hidden, self._num_tensors
            planes = self._slots[slot][: num * count * hidden].view(num, count, hidden)
            targets = None
            if len(spans) != num:
                targets = (planes.transpose(0, 1), tuple((count, k, hidden) for k in spans))
            views = self._views[key] = (planes, targets)
        return views
