"""A byte-level BPE tokenizer trained in a second on a few words: what the data-prepare tests
tokenize with (no model hub here)."""

import numpy as np

WORDS = ("the cat sat on a mat while rain fell over quiet hills and rivers ran to the sea "
         "under bright stars people walked home through old streets with lamps").split()


def train_tokenizer(path, vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(seed)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [" ".join(rng.choice(WORDS, size=30)) for _ in range(200)]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    return str(path)
