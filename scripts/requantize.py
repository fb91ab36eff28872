#!/usr/bin/env python3
"""Requantizes a GGUF with llama.cpp's own quantizer (llama-cpp-python's
`llama_model_quantize`, requantization allowed), e.g. the default Q4_1 SmolLM2 to Q4_0 or
Q8_0 for the CPU speed table (scripts/cpu_speed.sh).

Pinned: llama-cpp-python==0.3.36.
    python3 scripts/requantize.py IN.gguf OUT.gguf q4_0|q8_0|q4_1|q5_0|q5_1
"""
import os
import sys
import tempfile

import llama_cpp

FTYPES = {
    "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1,
    "q5_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_0,
    "q5_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_1,
    "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
}


def main():
    if len(sys.argv) != 4 or sys.argv[3] not in FTYPES:
        sys.exit(f"usage: {sys.argv[0]} IN.gguf OUT.gguf {'|'.join(FTYPES)}")
    src, dst, kind = sys.argv[1:]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    # Written beside the output and renamed into place: no half-written OUT on failure.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(dst)), suffix=".gguf.part")
    os.close(fd)
    try:
        rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), params)
        if rc != 0:
            sys.exit(f"llama_model_quantize failed ({rc}) on {src}")
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"wrote {dst} ({kind})")


if __name__ == "__main__":
    main()
