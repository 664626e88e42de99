"""`python -m inflight.run.scale --run-dir D --serves N`: more serves for a run of `inflight.run --launcher ray` that
is going on; each new serve joins the learner's weights group at its next update and its rollouts are trained on.

Run anywhere that sees the run directory (the driver's machine, or the shared file system): it writes
`<run_dir>/scale.json`, which the run's driver (inflight/run/ray_run.py) reads every half second, and waits for the
driver's `scaling` event in `events.jsonl` (the request taken; `scaled` follows once the new actors are placed).
Serves are only added: a serve is taken away by stopping its actor (`ray kill`), which the learner sees as a serve
that went quiet. Exit 0 once the driver took the request; 1 when no run of Ray goes on in that directory or the
driver did not answer in `--timeout-s`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def requested_serves(run_dir: Path) -> int:
    """The serves `scale.json` asks for (0 when there is no request, or an unreadable one)."""
    try:
        return int(json.loads((run_dir / "scale.json").read_text())["serves"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inflight.run.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, help="the run directory of a running `--launcher ray` run")
    parser.add_argument("--serves", type=int, required=True, help="how many serves the run should have (only more)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="how long to wait for the driver (default 120)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    config = run_dir / "run-config.json"
    if not config.exists() or json.loads(config.read_text()).get("launcher") != "ray":
        print(f"--run-dir {run_dir}: not the directory of an `inflight.run --launcher ray` run", file=sys.stderr)
        return 1
    if args.serves < 1:
        parser.error(f"--serves is {args.serves}, expected >= 1")
    events = _events(run_dir)
    running = {e["actor"] for e in events if e.get("event") == "placed" and e.get("actor", "").startswith("serve")}
    if args.serves <= len(running):
        print(f"{run_dir}: already {len(running)} serves; serves are only added", file=sys.stderr)
        return 0
    before = sum(e.get("event") == "scaling" for e in events)
    (run_dir / "scale.json").write_text(json.dumps({"serves": args.serves}) + "\n")
    deadline = time.monotonic() + args.timeout_s
    while time.monotonic() < deadline:
        taken = [e for e in _events(run_dir) if e.get("event") == "scaling"]
        if len(taken) > before or taken and taken[-1].get("serves", 0) >= args.serves:
            said = f"{run_dir}: the driver is adding serves up to {args.serves}"
            print(f"{said}; `[serve-N] inflight.serve ready` in its output says each is up", file=sys.stderr)
            return 0
        time.sleep(0.5)
    print(
        f"--run-dir {run_dir}: the run's driver did not take the request in {args.timeout_s:.0f}s (--timeout-s); "
        "is the run still going?",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
