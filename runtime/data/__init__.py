"""Training data: token datasets prepared on disk and the loader that feeds each dp rank its rows.

loader (`TokenDataset`, a prepared dataset read from its memory-mapped shards; `TokenLoader`, each
rank's share of every global batch, resumable under another dp degree), prepare (`prepare_tokens`:
text files to token shards and an index; `stderr_progress`) and corpus (`default_corpus`: the
standard library's own source, prepared once). `autopar run` and `autopar data` use exactly these
five names, imported from their modules (nothing is re-exported here).
"""
