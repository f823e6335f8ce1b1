"""A stand-in for llama.cpp's converter: writes the source folder's config.json as the "GGUF";
a folder holding REFUSE fails with llama.cpp's kind of error line, its text verbatim."""
import argparse
import sys
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--outtype")
ap.add_argument("--outfile")
ap.add_argument("--target-model-dir")
args = ap.parse_args()
src = Path(args.model)
if (src / "REFUSE").is_file():
    print(f"ValueError: {(src / 'REFUSE').read_text()}", file=sys.stderr)
    sys.exit(1)
text = (src / "config.json").read_text()
Path(args.outfile).write_text(text + (f"\ntarget={args.target_model_dir}" if args.target_model_dir else ""))
