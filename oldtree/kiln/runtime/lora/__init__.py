"""Multi-LoRA at run time: PEFT adapters read and checked (``adapter``), the device slots holding the
resident ones (``slots``) and the registry that names them and hands slots out (``registry``)."""
