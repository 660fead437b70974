"""Prepares a release: checks the version against the tag, builds, checks, uploads nothing.

  python tools/release.py              # the tag is the one on HEAD (git describe --exact-match)
  python tools/release.py --tag v0.1.0 # before tagging, or on another commit

It stops with an error when ``optax_gsam.__version__`` is not the tag (``v0.1.0`` or
``0.1.0``), when CHANGELOG.md has no section for the version, when an existing tag is not on
HEAD, or when the work tree has uncommitted changes (``--allow-dirty`` skips that one); then it
builds the sdist and the wheel (``python -m build``, the wheel from the sdist), runs
``twine check --strict`` on both and prints the upload command it would run. Needs the
``release`` extra (``pip install -e ".[release]"``). RELEASING.md has the whole procedure.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


class ReleaseError(Exception):
  """A check failed; the message says which and what to do."""


def package_version(root: pathlib.Path = ROOT) -> str:
  """``__version__`` as written in optax_gsam/__init__.py (read, not imported)."""
  text = (root / "optax_gsam" / "__init__.py").read_text()
  match = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
  if match is None:
    raise ReleaseError('optax_gsam/__init__.py has no line __version__ = "...".')
  return match.group(1)


def check_tag(tag: str, version: str) -> None:
  """The tag names the version: ``v{version}`` or ``{version}``."""
  if tag not in (f"v{version}", version):
    raise ReleaseError(
      f"the tag {tag!r} does not match optax_gsam.__version__ {version!r}: tag the release "
      f"v{version}, or set __version__ in optax_gsam/__init__.py to the tag's version."
    )


def check_changelog(version: str, root: pathlib.Path = ROOT) -> None:
  """CHANGELOG.md has a ``## {version}`` section."""
  text = (root / "CHANGELOG.md").read_text()
  if not re.search(rf"^## \[?{re.escape(version)}\]?(\s|$)", text, re.M):
    raise ReleaseError(
      f"CHANGELOG.md has no '## {version}' section: move the Unreleased entries under it."
    )


def _git(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def resolve_tag(tag: str | None, allow_dirty: bool) -> str:
  """The tag to release: ``tag``, or the one on HEAD; an existing tag must be on HEAD."""
  if not allow_dirty and _git("status", "--porcelain").stdout.strip():
    raise ReleaseError("the work tree has uncommitted changes: commit them, or --allow-dirty.")
  if tag is None:
    described = _git("describe", "--tags", "--exact-match", "HEAD")
    if described.returncode != 0:
      raise ReleaseError("HEAD has no tag: tag it (git tag v<version>) or pass --tag.")
    return described.stdout.strip()
  tagged = _git("rev-list", "-n", "1", tag)
  head = _git("rev-parse", "HEAD")
  if tagged.returncode == 0 and tagged.stdout.strip() != head.stdout.strip():
    raise ReleaseError(f"the tag {tag!r} exists but is not on HEAD: check out the tagged commit.")
  return tag


def build(dist: pathlib.Path) -> list[pathlib.Path]:
  """The sdist and the wheel built from it, checked with ``twine check --strict``."""
  shutil.rmtree(dist, ignore_errors=True)
  subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], check=True)
  files = sorted(dist.glob("optax_gsam-*"))
  if len(files) != 2:
    raise ReleaseError(f"expected one sdist and one wheel in {dist}, got {files}.")
  subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, files)], check=True)
  return files


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tag", help="the release tag (default: the tag on HEAD)")
  parser.add_argument("--dist", type=pathlib.Path, default=ROOT / "dist", help="output folder")
  parser.add_argument("--allow-dirty", action="store_true", help="skip the clean-tree check")
  args = parser.parse_args(argv)
  try:
    version = package_version()
    tag = resolve_tag(args.tag, args.allow_dirty)
    check_tag(tag, version)
    check_changelog(version)
    files = build(args.dist)
  except ReleaseError as error:
    print(f"release: {error}", file=sys.stderr)
    return 1
  print(f"\noptax_gsam {version} (tag {tag}) is ready. Nothing was uploaded; the upload is:")
  print("  python -m twine upload " + " ".join(str(f) for f in files))
  for f in files:
    digest = hashlib.sha256(f.read_bytes()).hexdigest()
    print(f"  {f.name}  {f.stat().st_size:,} bytes  sha256 {digest}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
