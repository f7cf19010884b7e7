"""smallstalk: a durable job broker that speaks the beanstalkd protocol."""

__version__ = "0.1.0"
