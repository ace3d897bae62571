"""mpu package."""
