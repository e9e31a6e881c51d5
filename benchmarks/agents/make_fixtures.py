"""Turn raw relay captures (from capture.sh) into fixtures with nothing machine-specific in them.

    python benchmarks/agents/make_fixtures.py RAW_DIR tests/fixtures/clients/<client>-<version> [--only 02,03]

Replaces the capture's temporary folder by /work/task and its temporary home by /home/user (also in the
dashed form Claude Code uses for its per-project folder), Claude Code's device_id and Codex's installation_id
by zeros, and the kernel version in Claude Code's system prompt by `<os-version>`. Secret headers were already
redacted by relay.py. Per-session and per-request ids (session ids, tool-call ids, dates) are kept.
"""
import argparse
import json
import re
from pathlib import Path


def dashed(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "-", path)


def sanitize(text: str, tmp: str) -> str:
    for old, new in [(f"{tmp}/task", "/work/task"), (f"{tmp}/home", "/home/user"), (tmp, "/tmp/capture")]:
        text = text.replace(old, new).replace(dashed(old), dashed(new))
    for value in set(re.findall(r'device_id\\*"\s*:\s*\\*"([0-9a-f]{64})', text)):
        text = text.replace(value, "0" * 64)
    for value in set(re.findall(r'installation[-_]id\\*"\s*:\s*\\*"([0-9a-f-]{36})', text)):
        text = text.replace(value, "00000000-0000-0000-0000-000000000000")
    return re.sub(r"(OS Version: )[^\\\n\"]+", r"\1<os-version>", text)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--only", help="comma-separated capture numbers to keep, e.g. 02,03")
    args = p.parse_args()
    tmp = (args.raw / ".tmpdir").read_text().strip()
    keep = set(args.only.split(",")) if args.only else None
    args.out.mkdir(parents=True, exist_ok=True)
    for src in sorted(args.raw.glob("[0-9]*.json")):
        if keep is None or src.name.split("-")[0] in keep:
            text = sanitize(src.read_text(), tmp)
            json.loads(text)  # still valid JSON
            (args.out / src.name).write_text(text)
            print(args.out / src.name, len(text))


if __name__ == "__main__":
    main()
