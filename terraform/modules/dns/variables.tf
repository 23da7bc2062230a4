variable "zone_name" {
  description = "Public hosted zone holding the service name, e.g. example.com."
  type        = string
}

variable "record_name" {
  description = "The service name clients resolve, e.g. api.example.com."
  type        = string
}

variable "ttl" {
  description = "TTL of the latency records, in seconds (short: failover waits for it)."
  type        = number
  default     = 60
}

variable "balancers" {
  description = "One entry per balancer: its id (the record's set_identifier), public IPv4, HTTP port and AWS region."
  type = list(object({
    id     = string
    ip     = string
    port   = number
    region = string
  }))
}

variable "health_check_type" {
  description = "HTTP, or HTTPS when the balancers serve clients over TLS (Route53 does not verify the certificate)."
  type        = string
  default     = "HTTP"

  validation {
    condition     = contains(["HTTP", "HTTPS"], var.health_check_type)
    error_message = "health_check_type must be HTTP or HTTPS."
  }
}

variable "health_check_path" {
  description = "Path Route53 probes on every balancer (skymesh-lb answers /health)."
  type        = string
  default     = "/health"
}

variable "request_interval" {
  description = "Seconds between Route53 probes: 10 or 30."
  type        = number
  default     = 30
  validation {
    condition     = contains([10, 30], var.request_interval)
    error_message = "Route53 allows a request_interval of 10 or 30 seconds."
  }
}

variable "failure_threshold" {
  description = "Failed probes in a row before Route53 stops answering with a balancer."
  type        = number
  default     = 3
}

variable "tags" {
  description = "Tags for the health checks."
  type        = map(string)
  default     = {}
}
