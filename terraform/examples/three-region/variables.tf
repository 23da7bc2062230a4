variable "zone_name" {
  description = "Public Route53 hosted zone, e.g. example.com."
  type        = string
}

variable "record_name" {
  description = "The service name clients use, e.g. api.example.com."
  type        = string
}

variable "client_cidrs" {
  description = "Who may call the balancers (default: anyone; Route53's checkers must be able to)."
  type        = list(string)
  default     = ["0.0.0.0/0"]
}

variable "api_keys_ssm_param" {
  description = "SSM SecureString with the balancers' client API keys, one per line (every region reads the same path)."
  type        = string
  default     = "/skymesh/api-keys"
}

variable "tls_ssm_prefix" {
  description = "SSM path with edge.crt and edge.key for HTTPS on the client port, in every region (null: plain HTTP)."
  type        = string
  default     = null
}

variable "certs_ssm_prefix" {
  description = "SSM path where `skymesh certs` output was stored in every region (null: no mesh, region-local balancers)."
  type        = string
  default     = "/skymesh/pki"
}

variable "replica_urls" {
  description = "Existing replicas per region name (us-east, eu-west, ap-northeast)."
  type        = map(list(string))
  default     = {}
}

variable "emulated_replicas" {
  description = "Emulated replicas (skymesh-replica) per region, for trying the mesh without GPUs."
  type        = number
  default     = 2
}

variable "skymesh_wheel_url" {
  description = "The SkyMesh wheel every instance installs (s3://bucket/key.whl or https://...whl), from your own release bucket."
  type        = string
}

variable "skymesh_wheel_sha256" {
  description = "SHA-256 of that wheel (required); instances refuse a different file."
  type        = string
}

variable "skymesh_replica_wheel_url" {
  description = "The skymesh-replica wheel the emulated replicas install beside skymesh_wheel_url (needed when emulated_replicas > 0)."
  type        = string
  default     = null
}

variable "skymesh_replica_wheel_sha256" {
  description = "SHA-256 of that wheel (required with skymesh_replica_wheel_url)."
  type        = string
  default     = null
}

variable "ami_id" {
  description = "AMI for every instance in all three regions (one id must exist in each; null looks up the latest Debian 12 per region)."
  type        = string
  default     = null
}

variable "detailed_monitoring" {
  description = "CloudWatch detailed (1-minute) monitoring of every instance (extra cost per instance)."
  type        = bool
  default     = true
}

variable "pip_index_url" {
  description = "Package index for the wheel's dependencies (your mirror); null: PyPI through each region's NAT gateway."
  type        = string
  default     = null
}
