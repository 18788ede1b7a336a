"""lofast: train Lipschitz vision transformers and certify their l2 robustness with LoFAST.

The Python API (``lofast.api``), loaded on first use so that ``lofast --help`` never imports
torch:

    import lofast

    run = lofast.certify(eps=[0.02, 0.05], n=20)  # the shipped default, bundled test images
    print(run.summary.certified_accuracy)

load_model, list_models, load_data, certify, train and Certification come from ``lofast.api``;
Certifier and CertifySettings (one batch at a time, per-sample certificates as tensors) from
``lofast.certification.certificate``.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": "lofast.api", "load_data": "lofast.api", "certify": "lofast.api",
    "Certification": "lofast.api", "Certifier": "lofast.certification.certificate",
    "CertifySettings": "lofast.certification.certificate", "list_models": "lofast.api",
    "train": "lofast.api",
}
__all__ = ["Certification", "Certifier", "CertifySettings", "certify", "list_models",
           "load_data", "load_model", "train"]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lofast' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
