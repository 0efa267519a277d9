"""Print the pack's runtime dependencies (``[project] dependencies`` of pyproject.toml), one per line.

Used by scripts/setup_comfyui.sh to install them into ComfyUI's environment without installing the pack itself
(ComfyUI loads the pack from its folder). Python 3.10 has no tomllib: the array is then read with a regex.
"""
import re
import sys


def main(path: str) -> None:
    text = open(path, encoding="utf-8").read()
    try:
        import tomllib

        deps = tomllib.loads(text)["project"]["dependencies"]
    except ImportError:
        block = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.S | re.M).group(1)
        deps = re.findall(r'"([^"]+)"', block)
    print("\n".join(deps))


if __name__ == "__main__":
    main(sys.argv[1])
