import pytest

from fxshard.train.data.synthetic import train_tokenizer, write_corpus
from fxshard.train.data.tokenize import tokenize


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A generated corpus of 300 documents of 1 to 3 sentences (about 10 to 70 tokens), a 256-id BPE tokenizer
    trained on it, and the token file ``t.bin`` that `fxshard data tokenize` writes with the last 10% of the
    documents held out: ``(folder, summary)``."""
    root = tmp_path_factory.mktemp("tokens")
    write_corpus(root / "corpus", 300, files=2, sentences=(1, 3))
    train_tokenizer(root / "corpus", root / "tok", vocab=256)
    summary = tokenize(root / "corpus", root / "tok", root / "t.bin", validation=0.1)
    return root, summary


@pytest.fixture(scope="session")
def chat_corpus(tmp_path_factory):
    """300 generated conversations, the byte-level tokenizer with a chat template that `fxshard data generate
    --chat` trains (512 ids), and ``chat.bin`` (with ``chat.mask``) that `fxshard data tokenize --format chat
    --seq 128 --truncate drop --validation 0.1` writes: ``(folder, summary)``."""
    from fxshard.train.data.chat_tokenize import tokenize_chat
    from fxshard.train.data.synthetic_chat import train_chat_tokenizer, write_chat_corpus

    root = tmp_path_factory.mktemp("chat")
    write_chat_corpus(root / "corpus", 300)
    train_chat_tokenizer(root / "corpus", root / "tok", vocab=512)
    summary = tokenize_chat(root / "corpus", root / "tok", root / "chat.bin", seq=128, truncate="drop",
                            validation=0.1)
    return root, summary
