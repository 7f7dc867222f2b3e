"""What the benchmarks compare against: plain DDP / HSDP scripts, checkpoint-restart, torchft."""
