"""Run llama.cpp's own convert_hf_to_gguf.py on a tiny random HF model (subprocess entry).

This file runs in its OWN Python process (started by ggufcheck.testing.convert), because the
converter must import llama.cpp's vendored gguf-py, which differs from the gguf package
ggufcheck itself uses. It imports nothing from ggufcheck.

Tiny random models have no tokenizer files, so every model class's ``set_vocab`` is replaced
by one that copies a real vocabulary (SmolLM2's, from its GGUF) into the output. The weights
are converted by llama.cpp's code unchanged.

Usage: python _convert_script.py LLAMA_CPP_DIR VOCAB_GGUF HF_DIR OUT.gguf OUTTYPE [converter options]
"""

import importlib
import os
import pkgutil
import sys


def _patch_vocab(gguf, text_model_cls, vocab_gguf: str) -> None:
    vocab = gguf.GGUFReader(vocab_gguf)

    def field(key):
        return vocab.fields[key].contents()

    def set_vocab(self):
        w = self.gguf_writer
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(field("tokenizer.ggml.pre"))
        w.add_token_list(field("tokenizer.ggml.tokens"))
        w.add_token_types(field("tokenizer.ggml.token_type"))
        w.add_token_merges(field("tokenizer.ggml.merges"))
        w.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
        w.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))

    def all_subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from all_subclasses(sub)

    for model_class in [text_model_cls, *all_subclasses(text_model_cls)]:
        if "set_vocab" in vars(model_class):
            model_class.set_vocab = set_vocab


def main(argv: list[str]) -> None:
    llama_cpp_dir, vocab_gguf, hf_dir, out_file, out_type = argv[:5]
    here = os.path.dirname(os.path.abspath(__file__))  # keep this package dir off the path
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.insert(0, llama_cpp_dir + "/gguf-py")  # the converter expects its own gguf-py
    sys.path.insert(0, llama_cpp_dir)

    import gguf  # the vendored one (sys.path order above)
    import conversion
    import convert_hf_to_gguf
    from conversion.base import TextModel

    for module in pkgutil.iter_modules(conversion.__path__):  # model classes live in submodules
        importlib.import_module(f"conversion.{module.name}")
    _patch_vocab(gguf, TextModel, vocab_gguf)

    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", out_file, "--outtype", out_type, *argv[5:]]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(sys.argv[1:])
