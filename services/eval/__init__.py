"""Evaluation of KV-cache schemes against the raw cache on real text (`buttermilk eval-kv`)."""
