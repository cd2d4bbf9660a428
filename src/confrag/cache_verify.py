"""Check a whole cache: every sharded artifact's manifest, and every shard against its digest, shape and length.

    python -m confrag.cache_verify verify [CACHE_DIR]     (installed as: confrag-cache verify [CACHE_DIR])

CACHE_DIR defaults to the cache the runs use ($CONFRAG_CACHE, else <project>/.cache). Nothing is
written or deleted: a damaged shard is reported (a run recomputes it when it next needs it). The exit
status is 1 when some artifact is damaged, 2 when CACHE_DIR is not a directory, else 0. Incomplete
artifacts (a run interrupted, or still running) and shards written before digests existed are listed
but are not damage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from confrag.artifacts import CacheMismatchError, ShardedArtifact
from confrag.paths import default_cache_dir


@dataclass
class ArtifactCheck:
    directory: Path
    shards: int = 0
    problem: str = ""  # an unreadable or mismatched manifest
    damaged: list[tuple[str, str]] = field(default_factory=list)  # (shard file, what is wrong)
    missing: list[int] = field(default_factory=list)
    legacy: int = 0  # whole shards without a digest

    @property
    def is_damaged(self) -> bool:
        return bool(self.problem or self.damaged)


def check_artifact(directory: Path) -> ArtifactCheck:
    try:
        artifact = ShardedArtifact.from_directory(directory)
    except CacheMismatchError as err:
        return ArtifactCheck(directory, problem=str(err))
    check = ArtifactCheck(directory, shards=artifact.num_shards)
    for index in range(artifact.num_shards):
        status = artifact.inspect(index)
        if status.state == "damaged":
            check.damaged.append((artifact.shard_path(index).name, status.reason))
        elif status.state == "missing":
            check.missing.append(index)
        elif status.state == "legacy":
            check.legacy += 1
    return check


def verify_cache(root: Path | str) -> list[ArtifactCheck]:
    """Every artifact under `root` (any directory holding a manifest.json), checked, in path order."""
    return [check_artifact(manifest.parent) for manifest in sorted(Path(root).rglob("manifest.json"))]


def report(checks: Sequence[ArtifactCheck], root: Path) -> str:
    lines = []
    for check in checks:
        name = check.directory.relative_to(root)
        if check.problem:
            lines.append(f"DAMAGED     {name}: {check.problem}")
        for shard, reason in check.damaged:
            lines.append(f"DAMAGED     {name}/{shard}: {reason}")
        if check.missing:
            lines.append(
                f"INCOMPLETE  {name}: {len(check.missing)} of {check.shards} shards missing "
                f"(an interrupted or running computation; the next run computes them)"
            )
    damaged = sum(c.is_damaged for c in checks)
    incomplete = sum(bool(c.missing) and not c.is_damaged for c in checks)
    shards = sum(c.shards for c in checks)
    legacy = sum(c.legacy for c in checks)
    lines.append(
        f"{root}: {len(checks)} artifacts, {shards} shards: {len(checks) - damaged - incomplete} whole, "
        f"{damaged} damaged, {incomplete} incomplete"
    )
    if legacy:
        lines.append(
            f"{legacy} shard(s) were written before checksums: checked for shape and length only (a run "
            f"records their digest when it next reads them)"
        )
    if damaged:
        lines.append(
            "Damaged shards are recomputed by the next run that needs them; a damaged manifest means "
            "deleting its directory."
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m confrag.cache_verify", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="check every artifact of a cache; exit 1 if any is damaged")
    verify.add_argument(
        "cache_dir",
        nargs="?",
        type=Path,
        default=None,
        help="the cache directory (default: $CONFRAG_CACHE, else <project>/.cache)",
    )
    args = parser.parse_args(argv)
    root = args.cache_dir if args.cache_dir is not None else default_cache_dir()
    if not root.is_dir():
        print(f"{root}: not a directory (give the cache directory, e.g. the run's paths.cache_dir)", file=sys.stderr)
        return 2
    checks = verify_cache(root)
    print(report(checks, root))
    return 1 if any(c.is_damaged for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
