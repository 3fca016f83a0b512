"""Count measured figures quoted in code (issue 30, item 5), with the regex of tests/test_recipe_comments.py:
recipe comment lines, and lines of moec/kernels/*.py comments and docstrings; plus lines naming the H200.

    python3 scripts/count_measured_figures.py [TREE]     # TREE: a checkout (default: this one)
    git archive fd46df9 recipes moec/kernels | tar -x -C /tmp/old && python3 scripts/count_measured_figures.py /tmp/old
"""

from __future__ import annotations

import io
import sys
import tokenize
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "tests"))
from test_recipe_comments import comment_lines, measured_figures  # noqa: E402


def main() -> None:
    tree = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    shipped = tree / "moec" / "recipes"  # before issue 34 the recipes lived at the top of the tree
    recipes = sorted((shipped if shipped.is_dir() else tree / "recipes").rglob("*.yaml"))
    comments = [(p, i, t) for p in recipes for i, t in comment_lines(p)]
    hits = [(p, i, t) for p, i, t in comments if measured_figures(t)]
    for p, i, t in hits:
        print(f"{p.relative_to(tree)}:{i}: {[h for _, h in measured_figures(t)]}")
    kernel_hits = h200 = 0
    for p in sorted((tree / "moec" / "kernels").glob("*.py")):
        for tok in tokenize.generate_tokens(io.StringIO(p.read_text()).readline):
            if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU")[:3] in
                                                ('"""', "'''")):
                for j, line in enumerate(tok.string.splitlines()):
                    if measured_figures(line):
                        kernel_hits += 1
                        print(f"{p.relative_to(tree)}:{tok.start[0] + j}: {[h for _, h in measured_figures(line)]}")
                    h200 += "H200" in line
    print(f"recipes: {len(recipes)} files, {sum(len(p.read_text().splitlines()) for p in recipes)} lines, "
          f"{len(comments)} comment lines, {len(hits)} quoting measured figures")
    print(f"moec/kernels: {kernel_hits} comment/docstring lines quoting measured figures, {h200} naming the H200")


if __name__ == "__main__":
    main()
