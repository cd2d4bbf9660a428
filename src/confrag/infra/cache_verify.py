"""Check a whole cache: every sharded artifact's manifest, every shard against its digest, shape, length and
finiteness, and every single result (converted model, probe, reranker, BM25 and FAISS index) against its folder digest.

    python -m confrag.infra.cache_verify verify [--adopt] [CACHE_DIR]     (installed as: confrag-cache verify ...)

CACHE_DIR defaults to the cache the runs use ($CONFRAG_CACHE, else <project>/.cache). Nothing is
written or deleted: a damaged shard or result is reported (a run recomputes or rebuilds it when it next
needs it). A shard or result without a digest is not trusted (a run recomputes it); `--adopt` records
the digests of such shards and results that pass every other check, for a cache written before digests
existed, whose owner vouches for it (the only case where this command writes). The exit status is 1
when something is damaged or without a digest (and not adopted), 2 when CACHE_DIR is not a directory, 3
when it holds no artifact of a confrag cache, else 0. Incomplete artifacts (a run interrupted, or still
running) are listed but are not damage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from confrag.infra.digests import FOLDER_DIGEST, folder_problem, has_folder_digest, write_folder_digest
from confrag.infra.paths import default_cache_dir
from confrag.infra.sharded import CacheMismatchError, ShardedArtifact


@dataclass
class ArtifactCheck:
    directory: Path
    shards: int = 0
    problem: str = ""  # an unreadable or mismatched manifest
    damaged: list[tuple[str, str]] = field(default_factory=list)  # (shard file, what is wrong)
    missing: list[int] = field(default_factory=list)
    legacy: list[str] = field(default_factory=list)  # whole shards without a digest, not adopted
    adopted: int = 0  # shards (or a whole result) whose digest --adopt recorded
    single: bool = False  # a single result (a folder with a folder digest), not a sharded artifact

    @property
    def is_damaged(self) -> bool:
        return bool(self.problem or self.damaged)


# Single results, by where the runs put them in a cache: `<cache>/<kind>/<key>/`, and how each is
# recognised when it has no digest (written before digests).
SINGLE_RESULTS = {
    "models": "config.json",
    "probes": "probe.json",
    "rerankers": "config.json",
    "retrieval/bm25": "params.index.json",
    "retrieval/faiss": "meta.json",  # a FAISS index (index.faiss + meta.json), rebuilt by the run when damaged
}


def check_artifact(directory: Path, adopt: bool = False) -> ArtifactCheck:
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
            if adopt and artifact.adopt(index):
                check.adopted += 1
            else:
                check.legacy.append(artifact.shard_path(index).name)
    return check


def check_single(directory: Path, adopt: bool = False) -> ArtifactCheck:
    """A converted model, probe, reranker export or BM25 index against its folder digest."""
    check = ArtifactCheck(directory, shards=0, single=True)
    if not has_folder_digest(directory):
        if adopt:
            write_folder_digest(directory)
            check.adopted = 1
        else:
            check.legacy.append(FOLDER_DIGEST)
        return check
    check.problem = folder_problem(directory)
    return check


def single_results(root: Path) -> list[Path]:
    found = set()
    for kind, marker in SINGLE_RESULTS.items():
        parent = root / kind
        if parent.is_dir():
            found |= {
                p for p in parent.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / marker).is_file()
            }
    # A folder digest anywhere else (preference rows copied into the cache, say) is checked too.
    found |= {p.parent for p in root.rglob(FOLDER_DIGEST)}
    return sorted(found)


def verify_cache(root: Path | str, adopt: bool = False) -> list[ArtifactCheck]:
    """Every artifact under `root` (any directory holding a manifest.json, and every single result), checked,
    in path order. With `adopt`, shards and results without a digest that pass the other checks get one."""
    root = Path(root)
    sharded = [check_artifact(manifest.parent, adopt) for manifest in sorted(root.rglob("manifest.json"))]
    return sorted(sharded + [check_single(d, adopt) for d in single_results(root)], key=lambda c: c.directory)


def report(checks: Sequence[ArtifactCheck], root: Path) -> str:
    lines = []
    for check in checks:
        name = check.directory.relative_to(root)
        if check.problem:
            lines.append(f"DAMAGED     {name}: {check.problem}")
        for shard, reason in check.damaged:
            lines.append(f"DAMAGED     {name}/{shard}: {reason}")
        if check.legacy and check.single:
            lines.append(
                f"NO DIGEST   {name}: written before digests (or its digest was deleted); the next run rebuilds it"
            )
        elif check.legacy:
            lines.append(
                f"NO DIGEST   {name}: {len(check.legacy)} shard(s) without a digest ({', '.join(check.legacy[:3])}"
                f"{', ...' if len(check.legacy) > 3 else ''}); the next run recomputes them"
            )
        if check.missing:
            lines.append(
                f"INCOMPLETE  {name}: {len(check.missing)} of {check.shards} shards missing "
                f"(an interrupted or running computation; the next run computes them)"
            )
    damaged = sum(c.is_damaged for c in checks)
    unverified = sum(bool(c.legacy) and not c.is_damaged for c in checks)
    incomplete = sum(bool(c.missing) and not c.is_damaged and not c.legacy for c in checks)
    shards = sum(c.shards for c in checks)
    adopted = sum(c.adopted for c in checks)
    lines.append(
        f"{root}: {len(checks)} artifacts, {shards} shards: {len(checks) - damaged - unverified - incomplete} whole, "
        f"{damaged} damaged, {unverified} without digest, {incomplete} incomplete"
    )
    if adopted:
        lines.append(f"adopted: recorded the digest of {adopted} shard(s) or result(s) that had none")
    if unverified:
        lines.append(
            "Shards and results without a digest are not trusted: the next run recomputes them. For a cache "
            "written before digests that you trust, `verify --adopt` records their digests instead."
        )
    if damaged:
        lines.append(
            "Damaged shards are recomputed by the next run that needs them; a damaged manifest means "
            "deleting its directory."
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    # The whole module docstring, as written: its first line alone stopped mid-sentence.
    parser = argparse.ArgumentParser(
        prog="python -m confrag.infra.cache_verify",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="check every artifact of a cache; exit 1 if any is damaged")
    verify.add_argument(
        "--adopt",
        action="store_true",
        help="record the digests of shards and results that have none and pass every other check "
        "(a cache written before digests, which you trust)",
    )
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
    checks = verify_cache(root, adopt=args.adopt)
    if not checks:
        print(
            f"{root}: holds no confrag artifact (no manifest.json, no converted model, probe, reranker or index): "
            f"not a confrag cache, or an empty one; give the run's paths.cache_dir",
            file=sys.stderr,
        )
        return 3
    print(report(checks, root))
    return 1 if any(c.is_damaged or c.legacy for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
