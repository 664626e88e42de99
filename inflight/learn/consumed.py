"""ConsumedGroups: the ids of groups already trained, in memory (and checkpoint size) that does not grow with the run.

The learner must remember every trained group to refuse replays (a serve re-sending unacknowledged groups to a
restarted learner, the learner's own journal). A plain set of ids grows by every group of the run: 500 groups a step
for 10,000 steps is 5 million ids, about half a GB in memory and in every checkpoint's meta.json.

Serves name their groups `<stream>-g<index>` with indices counting up from 0 (one stream per serve start), and groups
are trained roughly in index order. So per stream this keeps a watermark (every index below it is trained) and the
few trained indices above it (groups that overtook an older, slower one). Ids of another form are kept as they are.

A group that never completes (its serve died mid-group, a sample was refused) would hold its stream's watermark back
for ever; once `window` trained indices have piled up above such a hole, the watermark jumps past it (logged). A serve
keeps at most `--max-outstanding` groups unacknowledged, far fewer than `window`, so nothing it can still send is
mistaken for trained.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable

log = logging.getLogger("inflight.learn")

WINDOW = 4096


def split_group_id(group_id: str) -> tuple[str, int] | None:
    """`<stream>-g<index>` -> (stream, index); None for an id of another form."""
    stream, sep, index = group_id.rpartition("-g")
    return (stream, int(index)) if sep and stream and index.isdigit() else None


class ConsumedGroups:
    def __init__(self, ids: Iterable[str] | dict = (), window: int = WINDOW):
        self.window = window
        self.marks: dict[str, int] = {}  # stream -> every index below is trained
        self.above: collections.defaultdict[str, set[int]] = collections.defaultdict(set)  # trained, >= the mark
        self.other: set[str] = set()
        if isinstance(ids, dict):  # the checkpoint form (to_json)
            self.marks.update({s: int(m) for s, m in ids.get("marks", {}).items()})
            for stream, indices in ids.get("above", {}).items():
                self.above[stream].update(int(i) for i in indices)
            self.other.update(ids.get("other", ()))
        else:  # a list of ids (also the checkpoint form before this class)
            for group_id in ids:
                self.add(group_id)

    def __contains__(self, group_id: str) -> bool:
        parsed = split_group_id(group_id)
        if parsed is None:
            return group_id in self.other
        stream, index = parsed
        return index < self.marks.get(stream, 0) or index in self.above.get(stream, ())

    def add(self, group_id: str) -> None:
        parsed = split_group_id(group_id)
        if parsed is None:
            self.other.add(group_id)
            return
        stream, index = parsed
        mark = self.marks.get(stream, 0)
        if index < mark:
            return
        above = self.above[stream]
        above.add(index)
        if len(above) > self.window:  # a hole that will never fill: jump past it
            log.warning(
                "stream %s: groups %d..%d never arrived whole; no longer waiting for them", stream, mark, min(above) - 1
            )
            mark = min(above)
        while mark in above:
            above.remove(mark)
            mark += 1
        self.marks[stream] = mark
        if not above:
            del self.above[stream]

    def __len__(self) -> int:
        """Ids held individually (not the trained count): what memory and checkpoints grow with."""
        return sum(len(a) for a in self.above.values()) + len(self.other)

    def to_json(self) -> dict:
        return {
            "marks": dict(self.marks),
            "above": {s: sorted(a) for s, a in self.above.items() if a},
            "other": sorted(self.other),
        }
