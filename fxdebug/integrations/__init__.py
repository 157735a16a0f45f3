"""fxdebug inside training frameworks: ``fxdebug.integrations.hf`` (the Hugging Face ``Trainer``)
and ``fxdebug.integrations.lightning`` (``lightning.Trainer``). Each is imported on its own, so
neither framework is needed to import fxdebug; importing one without its framework installed
raises ``ImportError`` naming the extra to install (``pip install 'fxdebug[hf]'`` / ``[lightning]``).
"""
