from __future__ import annotations

import threading

import pytest

from aerie import endpoints
from aerie.codec import pack_ids
from aerie.config import AerieConfig
from aerie.messages import (
    DetokenizeStart,
    FinishReason,
    RequestDelta,
    Shutdown,
    TextDeltas,
    TokenDeltas,
)
from aerie.transport import Receiver, Sender
from detokenizer_proc.process import build_server


@pytest.fixture
def config(tokenizer_dir, tmp_path) -> AerieConfig:
    return AerieConfig().replace(model={"tokenizer_path": tokenizer_dir}, runtime_dir=str(tmp_path))


def test_server_turns_token_deltas_into_text_deltas_until_shutdown(config, tokenizer):
    to_tokenizer = Receiver(endpoints.inbox(config, "tokenizer"))
    server = build_server(config)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    ids = tokenizer.encode("héllo 世界 🙂")
    start = DetokenizeStart(True, [], True, pack_ids(tokenizer.encode("Hi")))
    to_detok = Sender(endpoints.inbox(config, "detokenizer"))
    try:
        for i, token_id in enumerate(ids):
            finish = FinishReason(type="length") if i == len(ids) - 1 else None
            deltas = [
                RequestDelta(
                    "r", pack_ids([token_id]), start=start if i == 0 else None, finish=finish
                )
            ]
            to_detok.send(TokenDeltas(deltas=deltas))
        text, finished = "", False
        while not finished:
            message = to_tokenizer.recv(timeout_s=10)
            assert isinstance(message, TextDeltas)
            for out in message.deltas:
                text += out.text
                finished = out.finish is not None
        assert text == "héllo 世界 🙂"
        to_detok.send(Shutdown())
        thread.join(timeout=10)
        assert not thread.is_alive()
    finally:
        to_detok.close()
        to_tokenizer.close()


def test_unknown_message_is_a_loud_error(config):
    server = build_server(config)
    try:
        with pytest.raises(TypeError, match="unexpected TextDeltas"):
            server.handle_messages([TextDeltas(deltas=[])])
    finally:
        server.close()
