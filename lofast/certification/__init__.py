"""Certification: clean activations and per-stage bounds -> certificates (``certificate``), the
pipeline on a data set with its fallbacks, attacks, resume and shards (``pipeline``), the
per-sample records and their files (``records``), their summaries (``report``, ``plot``), and
the attacks (``attack``) and attention report (``attention_report``) that measure them."""
