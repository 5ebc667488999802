"""Every pip extra the docs, the README and the messages name exists in setup.py; docs/slurm.md
lists the sbatch scripts there are; docs/inference.md's sample is generate_demo.sh's prompts."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# `.[a,b]` / `megatron-mesh[a]` in an install line; "the `a` extra", "the `a` and `b` extras"
BRACKETS = re.compile(r"(?:megatron-mesh|pip install [^\n]*?\.)\[([a-z0-9_,-]+)\]")
NAMED = re.compile(r"the `([a-z0-9_-]+)`(?: and `([a-z0-9_-]+)`)? extras?\b")


def extras() -> set[str]:
    """The keys of setup.py's extras_require."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return {ast.literal_eval(key) for key in node.value.keys}
    raise AssertionError("setup.py has no extras_require")


def named(text: str) -> set[str]:
    found = {name for group in BRACKETS.findall(text) for name in group.split(",")}
    found |= {name for pair in NAMED.findall(text) for name in pair if name}
    return found


def test_extras_named_in_docs_and_messages_exist() -> None:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "megatron_mesh").rglob("*.py")), *sorted((ROOT / "scripts").glob("*"))]
    valid = extras()
    wrong = {f"{path.relative_to(ROOT)}: {name}" for path in files if path.is_file()
             for name in named(path.read_text(errors="replace")) if name not in valid}
    assert not wrong, f"extras not in setup.py ({sorted(valid)}): {sorted(wrong)}"
    assert {"megatron", "tensorboard"} <= {n for p in files if p.is_file()
                                          for n in named(p.read_text(errors="replace"))}


def test_slurm_doc_lists_every_sbatch_script() -> None:
    """docs/slurm.md counts and names each script of scripts/slurm/ in its table."""
    scripts = sorted(p.name for p in (ROOT / "scripts" / "slurm").glob("*.sbatch"))
    text = (ROOT / "docs" / "slurm.md").read_text()
    words = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
    assert f"holds {words[len(scripts)]} sbatch scripts" in " ".join(text.split()), scripts
    listed = sorted(re.findall(r"^\| `([\w.-]+\.sbatch)` \|", text, re.MULTILINE))
    assert listed == scripts


def test_inference_sample_is_the_demo_prompts() -> None:
    """docs/inference.md's sample output continues the prompts scripts/generate_demo.sh
    reads (examples/prompts.txt, NullTokenizer ids), and its prefill counts their tokens."""
    demo = (ROOT / "scripts" / "generate_demo.sh").read_text()
    assert "--prompts-file examples/prompts.txt" in demo
    prompts = (ROOT / "examples" / "prompts.txt").read_text().splitlines()
    text = (ROOT / "docs" / "inference.md").read_text()
    for prompt in prompts:
        assert re.search(rf"^ +{re.escape(prompt)} -> \d", text, re.MULTILINE), prompt
    tokens = sum(len(p.split()) for p in prompts)
    assert f"prefill: {tokens} prompt tokens ({len(prompts)} prompts)" in text
