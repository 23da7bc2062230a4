variable "name" {
  description = "Short region name used in balancer ids and tags, e.g. us-east."
  type        = string
}

variable "vpc_id" {
  description = "Existing VPC to use; null creates one."
  type        = string
  default     = null
}

variable "subnet_ids" {
  description = "Existing public subnets (with vpc_id); empty creates them."
  type        = list(string)
  default     = []
}

variable "vpc_cidr" {
  description = "CIDR of the VPC this module creates."
  type        = string
  default     = "10.20.0.0/16"
}

variable "availability_zones" {
  description = "How many availability zones the created subnets span."
  type        = number
  default     = 2
}

variable "instance_type" {
  description = "Balancer instance type (the balancer is CPU-only)."
  type        = string
  default     = "c7i.large"
}

variable "ami_id" {
  description = "AMI for balancers and replicas; null looks up the latest Debian 12 (Python 3.11) published by ami_owner."
  type        = string
  default     = null
}

variable "balancer_count" {
  description = "Balancers in this region; each is an Auto Scaling group of one with its own Elastic IP and mesh identity."
  type        = number
  default     = 1
}

variable "lb_port" {
  description = "The balancers' HTTP port (OpenAI API, /health, /ready, /metrics)."
  type        = number
  default     = 8080
}

variable "peering_port" {
  description = "The balancers' gRPC peering port (mutual TLS)."
  type        = number
  default     = 7001
}

variable "client_cidrs" {
  description = "Who may call the balancers' HTTP port (clients, Route53 health checkers, Prometheus)."
  type        = list(string)
  default     = ["0.0.0.0/0"]
}

variable "peer_cidrs" {
  description = "Who may open the peering port (the other regions' balancers, /32 each)."
  type        = list(string)
}

variable "policy" {
  description = "Routing policy of the balancers (skymesh-lb policy names)."
  type        = string
  default     = "prefix-tree"
}

variable "replica_urls" {
  description = "Existing replicas (vLLM, SGLang) the balancers serve from, e.g. http://10.20.1.50:8000."
  type        = list(string)
  default     = []
}

variable "replica_kind" {
  description = "How the balancer probes replica_urls: vllm, sglang or skymesh."
  type        = string
  default     = "vllm"
}

variable "replica_count" {
  description = "Emulated replicas (skymesh-replica) this module runs itself, for a dry run of the mesh."
  type        = number
  default     = 0
}

variable "replica_instance_type" {
  description = "Instance type of the emulated replicas."
  type        = string
  default     = "c7i.large"
}

variable "replica_profile" {
  description = "Engine profile of the emulated replicas (skymesh-replica --list-profiles)."
  type        = string
  default     = "llama3.1-8b-l4"
}

variable "mesh_peers" {
  description = "The other regions' balancers: id (certificate name) and host:port of their peering listener."
  type = list(object({
    id      = string
    address = string
  }))
  default = []
}

variable "api_keys_ssm_param" {
  description = "SSM parameter (SecureString, absolute path such as /skymesh/api-keys) holding the balancers' client API keys, one per line; skymesh-lb serves no client without one."
  type        = string

  validation {
    condition     = startswith(var.api_keys_ssm_param, "/")
    error_message = "api_keys_ssm_param must be an absolute SSM parameter path such as /skymesh/api-keys."
  }
}

variable "tls_ssm_prefix" {
  description = "SSM path holding edge.crt (chain first) and edge.key (SecureString) for HTTPS on the balancers' client port; null serves plain HTTP."
  type        = string
  default     = null
}

variable "certs_ssm_prefix" {
  description = "SSM Parameter Store path holding ca.crt, <id>.crt and <id>.key (SecureString) from `skymesh certs`; null runs without the mesh."
  type        = string
  default     = null
}

variable "skymesh_wheel_url" {
  description = "The SkyMesh wheel every instance installs: s3://bucket/key.whl (read with the instance role) or https://.../name.whl. Build it with `make wheels` (or `pip wheel --no-deps -w dist .`); pin it per release."
  type        = string

  validation {
    condition     = can(regex("^(s3|https)://[^ ]+/skymesh-[^/ ]+\\.whl$", var.skymesh_wheel_url))
    error_message = "skymesh_wheel_url must be s3://BUCKET/KEY/skymesh-VERSION-....whl or https://HOST/PATH/skymesh-VERSION-....whl."
  }
}

variable "skymesh_wheel_sha256" {
  description = "SHA-256 of the wheel (hex, required); the instance refuses a wheel that does not match, so a changed file in the bucket is never installed."
  type        = string

  validation {
    condition     = can(regex("^[0-9a-f]{64}$", var.skymesh_wheel_sha256))
    error_message = "skymesh_wheel_sha256 must be the wheel's SHA-256: 64 lower-case hex digits."
  }
}

variable "skymesh_replica_wheel_url" {
  description = "The skymesh-replica wheel the emulated replicas install beside skymesh_wheel_url (s3://bucket/key.whl or https://.../skymesh_replica-VERSION-....whl); needed when replica_count > 0. Build it with `pip wheel --no-deps -w dist ./replica`."
  type        = string
  default     = null

  validation {
    condition     = var.skymesh_replica_wheel_url == null || can(regex("^(s3|https)://[^ ]+/skymesh_replica-[^/ ]+\\.whl$", var.skymesh_replica_wheel_url))
    error_message = "skymesh_replica_wheel_url must be s3://BUCKET/KEY/skymesh_replica-VERSION-....whl or https://HOST/PATH/skymesh_replica-VERSION-....whl."
  }
}

variable "skymesh_replica_wheel_sha256" {
  description = "SHA-256 of the skymesh-replica wheel (hex); required with skymesh_replica_wheel_url."
  type        = string
  default     = null

  validation {
    condition     = var.skymesh_replica_wheel_sha256 == null || can(regex("^[0-9a-f]{64}$", var.skymesh_replica_wheel_sha256))
    error_message = "skymesh_replica_wheel_sha256 must be 64 lower-case hex digits."
  }
}

variable "detailed_monitoring" {
  description = "CloudWatch detailed (1-minute) monitoring of balancers and replicas; it costs extra per instance (false: 5-minute basic monitoring)."
  type        = bool
  default     = true
}

variable "pip_index_url" {
  description = "Package index for the wheel's dependencies (a mirror or CodeArtifact the operator runs); null uses pip's default (PyPI, through the NAT gateway)."
  type        = string
  default     = null
}

variable "ami_owner" {
  description = "Account that publishes the AMI looked up when ami_id is null (default: Debian's official account)."
  type        = string
  default     = "136693071363"
}

variable "replica_subnet_id" {
  description = "With vpc_id: the subnet for emulated replicas (it must reach apt and the package index); null uses the first of subnet_ids. Without vpc_id the module makes a private subnet behind a NAT gateway."
  type        = string
  default     = null
}

variable "health_check_grace_period" {
  description = "Seconds after launch before a failing health check may replace a balancer (first boot installs the wheel)."
  type        = number
  default     = 600
}

variable "tags" {
  description = "Tags for everything this module creates."
  type        = map(string)
  default     = {}
}
