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

variable "pip_spec" {
  description = "What the instances pip-install (version, wheel URL or git URL)."
  type        = string
  default     = "skymesh==0.1.0"
}
