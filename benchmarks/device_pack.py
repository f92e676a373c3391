"""The device script's bookkeeping: mark a block's JSON with how the block ended, and pack a work folder
into what a device call returns (at most 8 files, none more than two folders down, each under 16 MiB).

    python benchmarks/device_pack.py mark WORK/speed_bf16.json --block speed_bf16 --exit 124 --seconds 170 --limit 170
    python benchmarks/device_pack.py pack WORK OUT

``pack`` copies the result JSONs at the top of WORK (at most ``MAX_JSONS``; any more go into the logs), one
``logs.tar.gz`` (every ``*.log``, ``env.txt`` and the small records of the study folders in WORK: summary,
environment, config, report, arm records, replicas table) and one ``profile.tar.gz`` of ``WORK/profile``
(the whole folder when it packs under the size limit, else the smallest candidate's trace that fits). It
is idempotent: the device script calls it at the end and again from its EXIT trap.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tarfile
from pathlib import Path

MAX_FILES = 8  # what a device call brings back
MAX_BYTES = 16 * 2**20  # per file
MAX_JSONS = MAX_FILES - 2  # the rest: logs.tar.gz and profile.tar.gz
INTERRUPTED_EXITS = {124, 130, 137, 143}  # timeout's own, SIGINT, SIGKILL, SIGTERM
STUDY_RECORDS = ("summary.json", "environment.json", "config.json", "report.md", "replicas.csv", "arms/*.json")


def mark(path: Path, block: str, exit_code: int, seconds: float, limit: float) -> dict:
    """Record in the block's JSON how the block ended; a JSON the block never wrote (or left unreadable)
    becomes a record of its own, so every block started has one."""
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict):
            record = {"result": record}
    except (OSError, ValueError):
        record = {}
    if exit_code in INTERRUPTED_EXITS:
        status = "interrupted"
    elif exit_code != 0:
        status = "failed"
    else:
        status = record.get("status") if record.get("status") in ("interrupted", "failed") else "complete"
    if not record and status == "complete":
        status = "failed"  # exit 0 without its JSON: nothing was measured
    record["status"] = status
    record["block"] = {"name": block, "exit": exit_code, "seconds": round(seconds, 1), "limit_s": limit}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return record


def _tar(members: list[tuple[Path, str]], level: int = 6) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=level) as tar:
        for path, name in members:
            tar.add(path, arcname=name)
    return buf.getvalue()


def _log_members(work: Path, extra_jsons: list[Path]) -> list[tuple[Path, str]]:
    members = [(p, p.name) for p in sorted(work.glob("*.log"))]
    members += [(p, p.name) for p in (work / "env.txt",) if p.is_file()]
    members += [(p, p.name) for p in extra_jsons]
    for study in sorted(d for d in work.iterdir() if d.is_dir() and (d / "config.json").is_file()):
        for pattern in STUDY_RECORDS:
            members += [(p, p.relative_to(work).as_posix()) for p in sorted(study.glob(pattern)) if p.is_file()]
    return members


def _profile_archive(profile: Path) -> bytes | None:
    """The whole profile folder if it packs under the limit, else the smallest candidate's trace that does."""
    if not profile.is_dir() or not any(p.is_file() for p in profile.rglob("*")):
        return None
    whole = _tar([(profile, "profile")], level=9)
    if len(whole) < MAX_BYTES:
        return whole
    for cand in sorted((d for d in profile.iterdir() if d.is_dir()),
                       key=lambda d: sum(p.stat().st_size for p in d.rglob("*") if p.is_file())):
        one = _tar([(cand, f"profile/{cand.name}")], level=9)
        if len(one) < MAX_BYTES:
            return one
    return None


def pack(work: Path, out: Path) -> list[Path]:
    """Copy WORK's results into OUT within a device call's limits; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    jsons = sorted(p for p in work.glob("*.json") if p.is_file())
    kept = [p for p in jsons if p.stat().st_size < MAX_BYTES][:MAX_JSONS]
    written = []
    for p in kept:
        if p.resolve() != (out / p.name).resolve():
            shutil.copyfile(p, out / p.name)
        written.append(out / p.name)
    logs = _tar(_log_members(work, [p for p in jsons if p not in kept]))
    if len(logs) >= MAX_BYTES:  # a runaway log: the tails only
        tails = out / "_tails"
        tails.mkdir(exist_ok=True)
        members = []
        for path, name in _log_members(work, []):
            t = tails / name.replace("/", "_")
            t.write_bytes(path.read_bytes()[-2**20:])
            members.append((t, name))
        logs = _tar(members)
        shutil.rmtree(tails)
    (out / "logs.tar.gz").write_bytes(logs)
    written.append(out / "logs.tar.gz")
    profile = _profile_archive(work / "profile")
    if profile is not None:
        (out / "profile.tar.gz").write_bytes(profile)
        written.append(out / "profile.tar.gz")
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)
    m = sub.add_parser("mark", help="record how a block ended in its JSON")
    m.add_argument("json", type=Path)
    m.add_argument("--block", required=True)
    m.add_argument("--exit", type=int, required=True)
    m.add_argument("--seconds", type=float, required=True)
    m.add_argument("--limit", type=float, required=True)
    k = sub.add_parser("pack", help="copy a work folder's results into the returned folder")
    k.add_argument("work", type=Path)
    k.add_argument("out", type=Path)
    args = p.parse_args(argv)
    if args.verb == "mark":
        print(mark(args.json, args.block, args.exit, args.seconds, args.limit)["status"])
        return 0
    files = pack(args.work, args.out)
    for f in files:
        print(f"{f.stat().st_size:>10} {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
