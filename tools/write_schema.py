"""Write docs/plan.schema.json, the JSON schema of plan files (a test keeps it current).

Usage: python tools/write_schema.py
"""

import json
from pathlib import Path

from potluck.plans import plan_json_schema

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "docs" / "plan.schema.json"


def schema_text() -> str:
    return json.dumps(plan_json_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(schema_text())
