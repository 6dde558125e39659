"""The detokenizer process loop: receive TokenDeltas, send TextDeltas. Only moves messages.

Inbox: `endpoints.inbox(config, "detokenizer")` (TokenDeltas from the scheduler, Shutdown from
the launcher). Outbox: the tokenizer process's inbox. Everything available is drained each
turn and answered with one TextDeltas message, so a backlog costs one send, not one per step.
What heartbeats report (`aerie.process.Progress`): busy from a turn's messages to its send.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aerie import endpoints
from aerie.config import AerieConfig
from aerie.hf_tokenizer import load_hf_tokenizer
from aerie.messages import Shutdown, TextDelta, TextDeltas, TokenDeltas
from aerie.process import Progress, run_process
from aerie.transport import Receiver, Sender
from detokenizer_proc.incremental import Detokenizer


class DetokenizerServer:
    """The detokenizer core plus its two sockets; handlers dispatched by message type."""

    def __init__(
        self,
        detokenizer: Detokenizer,
        inbox: Receiver,
        to_tokenizer: Sender,
    ) -> None:
        self.detokenizer = detokenizer
        self.inbox = inbox
        self.to_tokenizer = to_tokenizer
        self.progress = Progress()
        self.handlers: dict[type, Callable[[Any], None]] = {
            TokenDeltas: self.on_token_deltas,
            Shutdown: self.on_shutdown,
        }
        self.outgoing: list[TextDelta] = []
        self.running = True

    def serve(self) -> None:
        """Handle messages until Shutdown, then close the sockets. Unknown types raise."""
        try:
            while self.running:
                self.progress.end()
                first = self.inbox.recv()
                self.progress.begin("detokenizing")
                self.handle_messages([first, *self.inbox.drain()])
        finally:
            self.close()

    def handle_messages(self, messages: list[Any]) -> None:
        """Dispatch each message, then send every resulting text delta in one TextDeltas."""
        for message in messages:
            handler = self.handlers.get(type(message))
            if handler is None:
                raise TypeError(f"detokenizer got an unexpected {type(message).__name__}")
            handler(message)
        if self.outgoing:
            self.to_tokenizer.send(TextDeltas(deltas=self.outgoing))
            self.outgoing = []

    def on_token_deltas(self, message: TokenDeltas) -> None:
        self.outgoing.extend(self.detokenizer.handle(message).deltas)

    def on_shutdown(self, message: Shutdown) -> None:
        self.running = False

    def close(self) -> None:
        self.inbox.close()
        self.to_tokenizer.close()


def load_tokenizer(config: AerieConfig):
    path = config.model.tokenizer_path or config.model.model_path
    if path is None:
        raise ValueError("the detokenizer needs a resolved tokenizer_path or model_path")
    return load_hf_tokenizer(path)


def build_server(config: AerieConfig) -> DetokenizerServer:
    return DetokenizerServer(
        detokenizer=Detokenizer(load_tokenizer(config)),
        inbox=Receiver(endpoints.inbox(config, "detokenizer")),
        to_tokenizer=Sender(endpoints.inbox(config, "tokenizer")),
    )


def run_detokenizer_process(config: AerieConfig) -> None:
    """Entry point of the detokenizer process (spawned by launch.py)."""
    run_process("detokenizer", config, build_server, DetokenizerServer.serve)
