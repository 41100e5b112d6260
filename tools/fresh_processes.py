"""The CPU tools' shared loop: each (case, engine) measured by the tool itself in a
fresh process (``--worker CASE ENGINE``), on the memconv of ``--tree`` (this checkout
or a worktree of another commit), its record the worker's last line of JSON.

Used by ``tools/cpu-compiled-step.py``, ``tools/cpu-compiled-streaming.py`` and
``tools/cpu-streaming-floor.py``; run those, not this.
"""

import json
import os
import subprocess
import sys


def commit_of(tree: str) -> str:
    """The short commit of the checkout at ``tree`` (empty where it is no git checkout
    or there is no git, as on a machine given a copy of the files)."""
    try:
        out = subprocess.run(
            ["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
    except OSError:
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def run_each(script: str, cases, engines, tree: str, options: list[str], json_path=None):
    """``(records, failed)``: ``script --worker case engine --tree tree *options`` for
    each case and engine, one fresh process each, alternating engines within a case.
    Each record gains the load average after it and the tree's commit; it is printed
    as a JSON line and, with ``json_path``, appended to that JSON Lines file. A worker
    that fails prints the end of its error output and counts in ``failed``."""
    commit = commit_of(tree)
    records, failed = [], 0
    for case in cases:
        for engine in engines:
            cmd = [sys.executable, script, "--worker", case, engine, "--tree", tree, *options]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                failed += 1
                continue
            record = json.loads(out.stdout.strip().splitlines()[-1])
            record["load_average"] = os.getloadavg()[0]
            record["commit"] = commit
            print(json.dumps(record), flush=True)
            records.append(record)
            if json_path:
                with open(json_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
    return records, failed
