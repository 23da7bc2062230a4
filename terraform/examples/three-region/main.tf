# Three regions (us-east-1, eu-west-1, ap-northeast-1), one balancer each, peered into a
# mesh, behind one latency-routed name with Route53 health checks.

locals {
  tags = { project = "skymesh", example = "three-region" }
  # Every balancer peers with the balancers of the other two regions.
  balancers = concat(module.us_east.balancers, module.eu_west.balancers, module.ap_northeast.balancers)
  peers_of = {
    for region in ["us-east", "eu-west", "ap-northeast"] : region => [
      for b in local.balancers : { id = b.id, address = b.peer } if !startswith(b.id, "lb-${region}-")
    ]
  }
  peer_cidrs_of = {
    for region in ["us-east", "eu-west", "ap-northeast"] : region => [
      for b in local.balancers : "${b.ip}/32" if !startswith(b.id, "lb-${region}-")
    ]
  }
}

module "us_east" {
  source    = "../../modules/region"
  providers = { aws = aws.us_east_1 }

  name                 = "us-east"
  vpc_cidr             = "10.20.0.0/16"
  client_cidrs         = var.client_cidrs
  peer_cidrs           = local.peer_cidrs_of["us-east"]
  mesh_peers           = local.peers_of["us-east"]
  certs_ssm_prefix     = var.certs_ssm_prefix
  api_keys_ssm_param   = var.api_keys_ssm_param
  tls_ssm_prefix       = var.tls_ssm_prefix
  replica_urls         = lookup(var.replica_urls, "us-east", [])
  replica_count        = var.emulated_replicas
  skymesh_wheel_url    = var.skymesh_wheel_url
  skymesh_wheel_sha256 = var.skymesh_wheel_sha256
  pip_index_url        = var.pip_index_url
  ami_id               = var.ami_id
  detailed_monitoring  = var.detailed_monitoring

  skymesh_replica_wheel_url    = var.skymesh_replica_wheel_url
  skymesh_replica_wheel_sha256 = var.skymesh_replica_wheel_sha256
  tags                         = local.tags
}

module "eu_west" {
  source    = "../../modules/region"
  providers = { aws = aws.eu_west_1 }

  name                 = "eu-west"
  vpc_cidr             = "10.21.0.0/16"
  client_cidrs         = var.client_cidrs
  peer_cidrs           = local.peer_cidrs_of["eu-west"]
  mesh_peers           = local.peers_of["eu-west"]
  certs_ssm_prefix     = var.certs_ssm_prefix
  api_keys_ssm_param   = var.api_keys_ssm_param
  tls_ssm_prefix       = var.tls_ssm_prefix
  replica_urls         = lookup(var.replica_urls, "eu-west", [])
  replica_count        = var.emulated_replicas
  skymesh_wheel_url    = var.skymesh_wheel_url
  skymesh_wheel_sha256 = var.skymesh_wheel_sha256
  pip_index_url        = var.pip_index_url
  ami_id               = var.ami_id
  detailed_monitoring  = var.detailed_monitoring

  skymesh_replica_wheel_url    = var.skymesh_replica_wheel_url
  skymesh_replica_wheel_sha256 = var.skymesh_replica_wheel_sha256
  tags                         = local.tags
}

module "ap_northeast" {
  source    = "../../modules/region"
  providers = { aws = aws.ap_northeast_1 }

  name                 = "ap-northeast"
  vpc_cidr             = "10.22.0.0/16"
  client_cidrs         = var.client_cidrs
  peer_cidrs           = local.peer_cidrs_of["ap-northeast"]
  mesh_peers           = local.peers_of["ap-northeast"]
  certs_ssm_prefix     = var.certs_ssm_prefix
  api_keys_ssm_param   = var.api_keys_ssm_param
  tls_ssm_prefix       = var.tls_ssm_prefix
  replica_urls         = lookup(var.replica_urls, "ap-northeast", [])
  replica_count        = var.emulated_replicas
  skymesh_wheel_url    = var.skymesh_wheel_url
  skymesh_wheel_sha256 = var.skymesh_wheel_sha256
  pip_index_url        = var.pip_index_url
  ami_id               = var.ami_id
  detailed_monitoring  = var.detailed_monitoring

  skymesh_replica_wheel_url    = var.skymesh_replica_wheel_url
  skymesh_replica_wheel_sha256 = var.skymesh_replica_wheel_sha256
  tags                         = local.tags
}

# Route53 is global; its API lives in us-east-1.
module "dns" {
  source    = "../../modules/dns"
  providers = { aws = aws.us_east_1 }

  zone_name         = var.zone_name
  record_name       = var.record_name
  ttl               = 60
  balancers         = [for b in local.balancers : { id = b.id, ip = b.ip, port = b.port, region = b.region }]
  health_check_type = var.tls_ssm_prefix != null ? "HTTPS" : "HTTP"
  tags              = local.tags
}
