"""lofast: train Lipschitz vision transformers and certify their l2 robustness with LoFAST."""

__version__ = "0.1.0"
