"""The README is a short user guide whose commands are the ones CI runs, the documentation's relative links
resolve, and everything the repository cites lives in the repository (issue 30, item 4)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 200

# design, benchmark and style notes that live outside the repository, and the folder that held them
_OUTSIDE = re.compile(r"\b(?:BENCHMARKS|DESIGN|STYLE)\.md\b|\.\./shared\b|/work/share[d]\b")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept),
    spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = _FENCE.sub("", md.read_text())
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M)}


def links(md: Path) -> list[str]:
    text = _FENCE.sub("", md.read_text())
    return [a or b for a, b in _LINK.findall(text)]


def broken_links(md: Path) -> list[str]:
    bad = []
    for target in links(md):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, frag = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(f"{target} (no {dest.relative_to(ROOT) if ROOT in dest.parents else dest})")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{target} (no heading #{frag} in {dest.relative_to(ROOT)})")
    return bad


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}: results go to docs/)"


def test_readme_runs_what_ci_runs():
    """.ci/run is README command (2) verbatim, and README shows it in a code block."""
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    command = ci[-1].strip()
    assert command.startswith("bash scripts/setup.sh && ") and "pytest" in command, command
    blocks = [b.strip() for b in re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.S | re.M)]
    assert command in blocks, f"README.md has no code block that is exactly .ci/run's command: {command}"


def test_readme_says_where_moe_numbers_come_from():
    text = " ".join(README.read_text().split())
    assert "demo-moe" in text and "SmolLM2" in text and "dense" in text
    assert "No real MoE weights can be downloaded" in text


def test_relative_links_resolve():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    bad = {p.relative_to(ROOT).as_posix(): b for p in pages if (b := broken_links(p))}
    assert not bad, f"broken relative links: {bad}"


def test_link_checker_sees_broken_links(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "b.md").write_text("# A heading, with `code`\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md) [ok](b.md#a-heading-with-code) [web](https://x.org/y)\n"
                    "```\n[in a fence](nowhere.md)\n```\n"
                    "[gone](missing.md) [bad anchor](b.md#nope) ![img](pic.png)\n")
    assert broken_links(page) == ["missing.md (no missing.md)", "b.md#nope (no heading #nope in b.md)",
                                  "pic.png (no pic.png)"]


def _repo_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored files (a walk of the tree where git is not available)."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode()
        return [ROOT / f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "__pycache__", ".venv", "out"}
        return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


def test_nothing_cites_notes_outside_the_repository():
    """The code, tests, recipes, scripts and docs cite docs/ pages, not notes the repository does not hold."""
    bad = []
    for f in _repo_files():
        if f == Path(__file__).resolve():
            continue  # this file holds the pattern and examples of what it rejects
        if not f.is_file() or f.stat().st_size > 20 << 20:
            continue
        data = f.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (safetensors, images)
        for i, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if _OUTSIDE.search(line):
                bad.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()[:120]}")
    assert not bad, "cite docs/benchmarks.md or docs/architecture.md instead:\n" + "\n".join(bad)


def test_the_citation_pattern():
    for s in ("see BENCHMARKS.md", "(DESIGN.md: seeds)", "STYLE.md", "../shared/peers/x.json"):
        assert _OUTSIDE.search(s), s
    for s in ("docs/benchmarks.md", "docs/architecture.md", "experts/shared/MLP", "BENCHMARKS"):
        assert not _OUTSIDE.search(s), s
