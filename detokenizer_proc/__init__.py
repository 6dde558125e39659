"""The detokenizer process: token ids from the scheduler in, text deltas to the tokenizer out.

Owns incremental detokenization per request (`incremental.IncrementalDetokenizer`, pure and
socket-free), the per-rid table that turns `TokenDeltas` into `TextDeltas`
(`incremental.Detokenizer`), stop-string trimming and hold-back (`stop_strings`), and the
process loop (`process.run_detokenizer_process`).
"""

from detokenizer_proc.incremental import Detokenizer, IncrementalDetokenizer

__all__ = ["Detokenizer", "IncrementalDetokenizer"]
