"""Scripts a test runs as the training entry point (torchrun ... <script>): pretrain_gpt2 with a
fault armed. Each is also importable, so forked ranks can arm the same fault."""
