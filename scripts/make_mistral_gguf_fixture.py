#!/usr/bin/env python3
"""Writes tests/fixtures/gguf-mistral.gguf for tests/suite/mistral_folder.rs:
scripts/make_gguf_fixture.py's tests/fixtures/gguf-llama.gguf with one key
added, `llama.attention.sliding_window` = 3 (gguf-py's
Keys.Attention.SLIDING_WINDOW), as llama.cpp stores a Mistral: architecture
`llama` with a window. The tensors are copied byte for byte.

    python3 scripts/make_mistral_gguf_fixture.py
"""

import logging
import pathlib

import gguf
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
WINDOW = 3


def main():
    logging.disable(logging.CRITICAL)
    reader = gguf.GGUFReader(FIXTURES / "gguf-llama.gguf")
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(FIXTURES / "gguf-mistral.gguf", arch=arch, endianess=reader.endianess)
    key = gguf.Keys.Attention.SLIDING_WINDOW.format(arch=arch)
    copy_with_new_metadata(reader, writer, {key: MetadataDetails(gguf.GGUFValueType.UINT32, WINDOW)}, [])
    print(f"wrote {FIXTURES / 'gguf-mistral.gguf'} with {key} = {WINDOW}")


if __name__ == "__main__":
    main()
