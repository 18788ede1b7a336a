"""Training: the certified loss (``objective``) on the end-to-end LoFAST bound (``bound``), the
resumable loop (``loop``) and the pipeline that builds the model and runs it (``pipeline``)."""
