"""CI runs exactly the README's test command (the project's rule 1), so neither can drift from the other."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(scripts/setup\.sh && scripts/test-deps\.sh[^\n]*)\n```", readme)
    assert len(commands) == 1, commands
    ci = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert ci == commands
    for check in ("ruff check", "ruff format --check", "mypy", "pytest"):
        assert check in commands[0]
